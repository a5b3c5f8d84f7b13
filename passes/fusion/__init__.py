"""Fusion and recomputation on the per-rank graph.

    driver.py         the fusion stages, in order, and what each fused (recorded in the plan)
    match.py          pattern-matching helpers the fusions share ("biased GEMM", single users)
    attention.py      explicit attention -> aten.scaled_dot_product_attention
    dropout.py        residual + dropout(y + b) -> Megatron's bias_dropout_add
    gelu.py           GPT-2's GeLU written out -> aten.gelu; bias + GeLU folded with the next GEMM
    recompute.py      activation recomputation (full, selective) as regions under torch.utils.checkpoint

The fused ops these passes insert are passes/ir/kernels.py, beside the other ops every pass recognises.
"""
