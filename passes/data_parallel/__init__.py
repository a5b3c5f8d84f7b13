"""Data parallelism inside the program: what a dp rank must share with the others for its loss to be the whole
batch's.

    batch_statistics.py  a loss's statistics over the batch's rows that it reads nonlinearly (a load-balancing
                         loss), found by tracing it again at dp times the rows, all-reduced over dp
"""
