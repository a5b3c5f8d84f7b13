"""The frontend: the traced ATen graph in the canonical form the analysis reads.

    canonicalize.py   one placeholder per tensor, aliases merged, no metadata asserts, view_as and tied weights,
                      in-place ops on fresh tensors nothing else reads spelled out of place
    context_regions.py  `with torch.autocast(...)` and `torch.no_grad()` bodies inlined between the enter and exit calls
    gemm_forms.py     every contraction of an activation with a 2-D weight as linear / mm / addmm
    grouped_gemm.py   mixture-of-experts GEMMs (a 3-D weight slice per expert) as fxpar's grouped ops
    unfuse.py         a fused projection cut into one GEMM per part, on row blocks of its weight (one K/V head)
    layers.py         what a transformer layer is: the repeated blocks of the module tree
    token_count.py    a token-mean loss proven, and what counts its valid targets (whole-batch semantics)
"""
