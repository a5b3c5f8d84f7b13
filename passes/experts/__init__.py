"""Expert parallelism: the experts of a mixture-of-experts layer split over the ep ranks (fxpar.init_mesh(ep=E)).

    find.py       the expert chains: the grouped GEMMs of one layer's experts and the row-wise ops between them,
                  found by what they compute (rows sorted by expert, offsets counted from the sorted ids)
    dispatch.py   the collectives that take each row to the rank holding its expert and bring the result back
                  (alltoall or allgather, Config.ep_dispatch)
    expert_parallel.py  each chain run on the rows routed to this rank's experts, on this rank's slice of their weights
"""
