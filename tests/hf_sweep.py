"""Every causal-LM architecture of the installed transformers, built from a tiny config in code, at t=2.

For each `model_type -> class` of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: build the class from its config with small
sizes (nothing downloaded), parallelize it on 2 threaded ranks (tests/threaded.py) and compare with the unmodified
model: the forward, and every parameter after one SGD step. A row records

    status     sharded (exact, and most parameters split: a local share of at most SHARDED = 0.62 at t=2; a float32
               gap over 1e-5 is rerun in float64, `arbiter`) | partly sharded (exact, a layer sharded, but a local
               share above 0.62) | replicated (exact, no layer sharded: at most the vocabulary)
               | refused (fxpar said why)
               | wrong (numbers differ) | crash (an error from inside fxpar) | no tiny build (transformers itself
               cannot build or run the tiny model: not counted)
    fwd, bwd   activation collectives per layer in forward and backward, the mean over the layers fxpar found
               (pm.plan.comm, passes/sharding/comm_audit.py): Megatron's layout needs 2 and 2. Those outside the layers
               (the vocabulary's) are not counted, nor those of a few values per token or of a weight's gradient
    share      of the parameters the traced program reads, those held on one rank (1.0: fully replicated; Megatron's
               layout at t=2 about 0.5)
    why        for a layer above 2 + 2, the plan's note on it; else the first reason the plan gives for what stayed
               replicated, or the refusal / error

    python -m tests.hf_sweep [--only llama qwen2 ...] [--markdown FILE] [--json FILE] [--readme docs/supported.md]
    (`make sweep` writes all three)
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import os
import sys
import time
import traceback
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.models import first_tensor, sgd_gaps  # noqa: E402
from tests.threaded import RankHang, Threaded, on_ranks, parallelize_traced  # noqa: E402

TOL = 1e-5
SHARDED = 0.62  # a local share at t=2 at most this: most parameters split (Megatron's layout holds about 0.5)
MAX_PARAMS = 20_000_000  # four copies per rank thread must fit a 2-core, 24 GB machine
VOCAB, BATCH, SEQ, LAYERS = 64, 2, 8, 2
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, ffn_hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, n_positions=64, n_ctx=64, n_embd=32,
            n_layer=LAYERS, n_head=4, d_model=32, ffn_dim=64, n_inner=64, num_layers=LAYERS, decoder_layers=LAYERS,
            encoder_layers=LAYERS, num_heads=4,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, n_routed_experts=4,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=8, attention_dropout=0.0,
            hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, dropout=0.0, use_cache=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)


def architectures() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink(config) -> None:
    """Set every TINY field the config has (its attribute_map aliases included), in its sub-configs too; every other
    vocabulary (`*vocab_size`) to VOCAB too, and every other embedding width (`*embedding_size`, `*embed_dim`) by
    the factor the hidden size shrinks by, so the tiny model keeps the real one's proportions (a roformer whose
    768-wide embeddings sit under a 32-wide model, or an extra 200k-row head, is no model anyone trains)."""
    scale = TINY["hidden_size"] / getattr(config, "hidden_size", 0) if getattr(config, "hidden_size", 0) else None
    for key, value in list(config.to_dict().items()):
        if not isinstance(value, int) or isinstance(value, bool) or key in TINY:
            continue
        new = VOCAB if key.endswith("vocab_size") else (
            max(8, round(value * scale / 8) * 8) if scale and key.endswith(("embedding_size", "embed_dim")) else None)
        try:
            if new is not None and new < value:
                setattr(config, key, new)
        except Exception:
            pass
    for key, value in TINY.items():
        try:  # a read-only property, or a per-layer attribute (set through its layer list, or not at all)
            if hasattr(config, key) or key in getattr(config, "attribute_map", {}):
                setattr(config, key, value)
        except Exception:
            pass
    for key, value in list(config.to_dict().items()):  # every dropout off: the comparison is of deterministic runs
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            try:
                setattr(config, key, 0.0)
            except Exception:
                pass
    from transformers import PretrainedConfig

    for sub in ("text_config", "decoder", "language_config"):
        if isinstance(getattr(config, sub, None), PretrainedConfig):
            _shrink(getattr(config, sub))
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:1]) * LAYERS if config.layer_types else None


def build(model_type: str, class_name: str):
    """(model, args, kwargs) of a tiny `class_name`, or raise (the row is then 'no tiny build')."""
    import transformers
    from transformers import AutoConfig

    transformers.logging.set_verbosity_error()
    config = AutoConfig.for_model(model_type)
    _shrink(config)
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config).train()
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    kwargs = {"use_cache": False} if "use_cache" in _forward_params(model) else {}
    size = sum(p.numel() for p in model.parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"not tiny: {size / 1e6:.0f}M parameters (a sub-config the sweep does not shrink)")
    with torch.no_grad():
        first_tensor(model(ids, **kwargs))  # transformers itself must run it
    return model, (ids,), kwargs


def _forward_params(model) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def _check_rank(model, args, kwargs, traced):
    """One rank: parallelize, compare forward and parameters after SGD, and read the plan."""
    from fxpar.passes.ir.meta import PARAMETER, input_of, placeholders
    from fxpar.passes.sharding.comm_audit import per_layer

    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize_traced(model, traced, args, kwargs)
        fwd, params = sgd_gaps(pm, reference, args, kwargs)
    read = {input_of(n).key for n in placeholders(traced.gm) if input_of(n).kind == PARAMETER}
    local = sum(p.numel() for k, p in pm.named_parameters() if k in read)
    total = sum(p.numel() for k, p in reference.named_parameters() if k in read)
    above = [c.note for c in pm.plan.above_bound]
    reasons = [f"above 2 + 2 in {pm.plan.above_bound[0].layer}: {above[0]}"] if above else []
    reasons += [r.reason for r in pm.plan.regions if r.reason]
    fwd_per_layer, bwd_per_layer = per_layer(pm.plan.comm)
    return {"fwd": fwd_per_layer, "bwd": bwd_per_layer, "fwd_gap": fwd, "param_gap": params, "share": local / total,
            "sharded": sum(r.kind == "tp" for r in pm.plan.sharded_regions), "why": reasons[0] if reasons else ""}


def _clean(text: str) -> str:
    """One line of at most 160 characters; a source path is shortened to its package path (transformers/...)."""
    return " ".join(re.sub(r"/\S*/site-packages/", "", text).split())[:160]


def sweep_one(model_type: str, class_name: str, timeout_s: float = 180.0) -> dict:
    from fxpar.trace import TraceError, trace

    row = {"arch": model_type, "class": class_name}
    try:
        model, args, kwargs = build(model_type, class_name)
    except Exception as e:
        return row | {"status": "no tiny build", "why": _clean(f"{type(e).__name__}: {e}")}
    try:
        traced = trace(model, args, kwargs)
    except TraceError as e:
        return row | {"status": "refused", "why": _clean(str(e))}
    try:
        results = _on_ranks(model, args, kwargs, traced, timeout_s)
    except RankHang as e:
        return row | {"status": "crash", "why": str(e)}
    bad = [r for r in results.values() if not isinstance(r, dict)]
    if bad:
        text = bad[0][1]
        last = text.strip().splitlines()[-1]
        clean = ("Error: fxpar" in text or "ValueError: fxpar" in text) and "PassError" not in text
        return row | {"status": "refused" if clean else "crash", "why": _clean(last)}
    r = results[0]
    gap = max(max(x["fwd_gap"], x["param_gap"]) for x in results.values())
    if gap > TOL:  # rounding the model amplifies, or a wrong rewrite: float64 tells them apart (as in tests/fuzz.py)
        row["arbiter"] = _arbitrate(model, args, kwargs, gap, timeout_s)
    fwd, bwd = r["fwd"], r["bwd"]
    status = "wrong" if gap > TOL and not row["arbiter"].startswith("exact") else \
        ("sharded" if r["share"] <= SHARDED else "partly sharded") if r["sharded"] else "replicated"
    return row | {"status": status, "gap": gap, "fwd": fwd, "bwd": bwd, "share": r["share"], "why": _clean(r["why"])}


def _on_ranks(model, args, kwargs, traced, timeout_s: float) -> dict:
    copies = [copy.deepcopy((model, args, kwargs)) for _ in range(2)]
    return on_ranks(lambda r: _check_rank(*copies[r], traced), 2, timeout_s)


def _arbitrate(model, args, kwargs, gap32: float, timeout_s: float) -> str:
    """'exact in float64 ...' when the rewrite agrees to 1e-10 in float64 and the float32 gap is within 10x of the
    unmodified model's own float32 error (its float32 run against its float64 run); else why not."""
    from fxpar.trace import trace

    wide = copy.deepcopy(model).double()
    m32, m64 = copy.deepcopy(model), copy.deepcopy(wide)
    own = max(sgd_gaps(m32, m64, args, kwargs))  # the same forward and SGD step, float32 against float64
    results = _on_ranks(wide, args, kwargs, trace(wide, args, kwargs), timeout_s)
    if any(not isinstance(x, dict) for x in results.values()):
        return "float64 run failed"
    gap64 = max(max(x["fwd_gap"], x["param_gap"]) for x in results.values())
    verdict = "exact in float64" if gap64 <= 1e-10 and gap32 <= 10 * own else "not exact in float64"
    return f"{verdict}: float32 gap {gap32:.2g}, the model's own float32 error {own:.2g}, float64 gap {gap64:.2g}"


def sweep(only=None) -> list[dict]:
    rows = []
    with Threaded():
        for model_type, class_name in architectures().items():
            if only and model_type not in only:
                continue
            start = time.perf_counter()
            try:
                row = sweep_one(model_type, class_name)
            except Exception:
                row = {"arch": model_type, "class": class_name, "status": "crash",
                       "why": _clean(traceback.format_exc().strip().splitlines()[-1])}
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            print(f"{model_type:28s} {row['status']:14s} {row.get('share', float('nan')):.2f}  {row['why'][:90]}",
                  flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    counted = [r for r in rows if r["status"] != "no tiny build"]
    by = {s: sum(r["status"] == s for r in counted)
          for s in ("sharded", "partly sharded", "replicated", "refused", "wrong", "crash")}
    above = sum(r["status"].endswith("sharded") and max(r["fwd"], r["bwd"]) > 2 for r in counted)
    head = (f"{len(counted)} of {len(rows)} architectures build from a tiny config; at t=2: "
            + ", ".join(f"{n} {s}" for s, n in by.items())
            + f" (sharded: a local share of at most {SHARDED} of the parameters read); {above} above Megatron's 2 + 2 "
              "all-reduces per layer, each named in the plan.\n\n")
    lines = ["| architecture | status | all-reduces / layer (fwd, bwd) | local share | why (first reason) |",
             "|---|---|---|---|---|"]
    for r in sorted(counted, key=lambda r: r["arch"]):
        ar = f"{r['fwd']:.1f}, {r['bwd']:.1f}" if "fwd" in r else ""
        share = f"{r['share']:.2f}" if "share" in r else ""
        lines.append(f"| {r['arch']} | {r['status']} | {ar} | {share} | {r['why'].replace('|', '/')} |")
    unbuilt = [r for r in rows if r["status"] == "no tiny build"]
    if unbuilt:
        why = "; ".join(f"{r['arch']} ({r['why'][:60].replace('|', '/')})"
                        for r in sorted(unbuilt, key=lambda r: r["arch"]))
        lines += ["", f"Not counted, {len(unbuilt)} whose tiny config transformers cannot build or run, or that stay "
                  f"above {MAX_PARAMS // 10 ** 6}M parameters: {why}."]
    return head + "\n".join(lines) + "\n"


BEGIN, END = "<!-- hf-sweep:begin (make sweep writes this) -->", "<!-- hf-sweep:end -->"


def into_readme(path: str, table: str) -> None:
    """Replace the text between BEGIN and END in `path` with the table (its summary line, then the rows folded)."""
    import transformers

    with open(path) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to fill")
    head, rows = table.split("\n\n", 1)
    body = (f"{BEGIN}\n{head} (transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]}; "
            f"`make sweep`)\n\n<details><summary>Every architecture</summary>\n\n{rows}\n</details>\n{END}")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    with open(path, "w") as f:
        f.write(text[:start] + body + text[end:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="fxpar over every Hugging Face causal LM at t=2 (tests/hf_sweep.py)")
    p.add_argument("--only", nargs="*", help="model types to run (default: all)")
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--readme", help="fill this README's supported-models section with the table")
    p.add_argument("--memory-gb", type=float, default=12.0,
                   help="address-space limit: a tiny config that still allocates gigabytes fails as 'no tiny build'")
    args = p.parse_args(argv)
    import resource

    limit = int(args.memory_gb * 2 ** 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    rows = sweep(set(args.only) if args.only else None)
    table = markdown(rows)
    print(table.splitlines()[0])
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.readme:
        into_readme(args.readme, table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["status"] in ("wrong", "crash") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
