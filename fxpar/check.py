"""The exactness proof for a user's own model and plan, on CPU: K optimizer steps of the parallel model against the
unmodified model on one process, on the same batches (`fxpar check`, fxpar/cli/check_command.py).

    result = check(CheckSpec(target="my_model.py:factory", tp=2, pp=2, steps=3))
    result.status   # "exact" | "mismatch" | "refused" | "failed"

The target's factory returns (model, example_args[, example_kwargs[, loss]]): `loss(output, *args, **kwargs)` is
one microbatch's scalar loss, given the model's output and the microbatch's inputs (a language model's loss takes
its targets from the token ids: examples/gpt.py `next_token_loss`). Without one, the loss is the model's own
`output.loss` where it has one (a Hugging Face model given `labels=` among the example's keyword arguments), else
the mean square of its first output tensor (every output element gets a gradient). The loss is traced with the
model, its inputs passed again as the pipeline's target ([Note: the loss is traced] in fxpar/trace.py).

How it runs. Each rank is a process of its own over gloo, started here (no torchrun, no port: a FileStore in a
temporary folder), because a pipeline's stages talk point to point, which torch's threaded process group lacks.
Every rank builds the model from the factory after the same torch.manual_seed, so each holds the same weights and
the same reference. Each step's global batch is dp*m pieces, one per dp slice and microbatch, each a copy of the
example with its values in a random order (a tensor's own values, so token ids stay valid; tensors that were the
same tensor stay the same tensor). A tensor of targets, one with -100 (cross-entropy's ignore_index) among its
values in the example, gets a fresh mask instead in every piece: its valid targets drawn again for every position,
then a random share of them (0 to all) set to -100, so the pieces count different numbers of valid targets, as
instruction tuning and packed sequences do, and a microbatch may have none; the last target of the global batch
stays valid where every other is ignored. fxpar trains on it with pm.step; the reference runs the unmodified model
on the whole global batch at once, on one process, which is what step() must equal ([Note: whole-batch semantics]
in passes/frontend/token_count.py), then steps the same optimizer.

[Tolerance] fp32: 1e-5 relative (to max(1, |value|)) on the loss and on every parameter after every step: what
summation order alone can change. One thing amplifies it: AdamW's step is lr * g / (|g| + eps) at first, whose
slope at g = 0 is lr / eps (1e5 at lr 1e-3), so a weight whose gradient is near zero turns the rounding of that
gradient (1e-10 absolute) into 1e-5 of its value, on any two summation orders. A fp32 gap above the bound is
therefore arbitrated in float64 (the model and its floating inputs cast to it), where rounding is 2^29 times
smaller: the same run must agree to 1e-10 there (measured on the example GPT: 7e-14 at t=2, 2e-14 at p=2 x t=2),
which a wrong rewrite, off by a real amount, never does. (The slope lr/eps times float64 rounding of 1e-18 stays
near 1e-13.) In that run `Tensor.float()` keeps float64 tensors as they are: models upcast with it meaning "at
least fp32" (Hugging Face's losses call `logits.float()`), and a float32 loss would bring fp32 rounding back (a
Qwen3 with labels=: 1e-6 with it, 2e-16 without).
bf16 (`--precision bf16`, Megatron's recipe: bf16 parameters and GEMMs, fp32 main gradients and parameters): two
runs. (1) bf16 against the same recipe on one process (the model cast to bf16, its floating inputs too, the loss on
outputs cast to fp32, the whole batch's bf16 gradients taken into fp32 main gradients, AdamW on fp32 main
parameters): the loss within 2e-3 relative at every step. bf16 keeps 8 significant bits (2^-9 = 2e-3 of rounding
per op), and a row-parallel GEMM rounds its partial sums before the all-reduce. Its parameters are not judged:
that rounding flips the sign of AdamW's first step on every weight whose gradient is near zero, a gap of 2 lr no
bound can tell from a wrong rewrite. (2) The same plan in fp32, judged on the loss and every parameter as above:
the rewrite does not depend on the precision (the bf16 program is the fp32 one with casts at its inputs and
outputs).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import tempfile
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

TOLERANCE = {"fp32": 1e-5, "fp64": 1e-10, "bf16": 2e-3}


@dataclass(frozen=True)
class CheckSpec:
    target: str  # path/file.py:factory or module:factory
    tp: int = 2
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert-parallel ranks among the dp ones (init_mesh(ep=E))
    # fxpar.Config fields to set (the CLI's Config flags); unset: 2 p v microbatches with a pipeline (else 1), the
    # default schedule for v (cost.bubble.default_schedule), and Config's defaults. seed and mixed_precision are the
    # check's own (seed, precision)
    config: dict = field(default_factory=dict)
    precision: str = "fp32"
    steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    timeout_s: float = 120.0  # of every collective

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep", "steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"fxpar check: --{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.precision not in TOLERANCE:
            raise ValueError(f"fxpar check: --precision must be fp32 or bf16, got {self.precision!r}")
        owned = sorted({"seed", "mixed_precision"} & set(self.config))
        if owned:
            raise ValueError(f"fxpar check sets Config.{owned[0]} itself: give --seed or --precision instead")
        self.parallel_config()  # a bad field is an error now, before any rank starts

    def parallel_config(self, mixed_precision=None):
        """The fxpar.Config the check parallelizes with."""
        from fxpar.config import Config
        from fxpar.cost.bubble import default_schedule

        vpp = self.config.get("virtual_stages", 1)
        m = 2 * self.pp * vpp if self.pp > 1 else 1
        defaults = {"microbatches": m, "schedule": default_schedule(vpp) if isinstance(vpp, int) else "1f1b"}
        try:
            return Config(**{**defaults, **self.config, "seed": self.seed, "mixed_precision": mixed_precision})
        except (TypeError, ValueError) as e:
            raise ValueError(f"fxpar check: {e}") from None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def m(self) -> int:
        return self.parallel_config().microbatches


@dataclass
class Step:
    loss: float  # fxpar's
    reference: float  # the unmodified model's
    gap: float  # the largest relative parameter difference after the step
    worst: str  # the parameter where it is


@dataclass
class CheckResult:
    status: str  # exact | mismatch | refused | failed
    spec: CheckSpec
    steps: list[Step] = field(default_factory=list)
    message: str = ""  # the refusal, the mismatch or the failure, in words
    ledger: list = field(default_factory=list)  # pm.plan.comm (passes/sharding/comm_audit.py LayerComm)
    bytes_per_element: int = 4
    tolerance: float = 1e-5
    arbiter: str = ""  # a fp32 gap the float64 run showed to be rounding ([Tolerance])
    low_steps: list[Step] = field(default_factory=list)  # --precision bf16: the bf16 run's (losses judged)
    reference_note: str = ""  # what the reference runs differently in float64 (Hugging Face's experts)


def unpack(out, spec: str):
    """(model, args, kwargs, loss) from a factory's (model, args[, kwargs[, loss]])."""
    from fxpar.targets import unpack_target

    if isinstance(out, tuple) and len(out) == 4:
        *out, loss = out
        if loss is not None and not callable(loss):
            raise ValueError(f"target {spec!r}: the 4th item the factory returns is loss(output, *args, **kwargs) -> "
                             "scalar, got "
                             f"{type(loss).__name__}")
        return (*unpack_target(tuple(out), spec), loss)
    return (*unpack_target(out, spec), None)


def default_loss(out, *args, **kwargs) -> torch.Tensor:
    """The model's own loss (`output.loss`, a Hugging Face model given labels=), else the mean square of its first
    floating output."""
    own = getattr(out, "loss", None)
    if isinstance(own, torch.Tensor):
        return own
    first = next((x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()), None)
    if first is None:
        raise ValueError("fxpar check: the model returns no floating-point tensor to take a loss of; return "
                         "(model, args, kwargs, loss) from the factory, with loss(output, *args, **kwargs) -> scalar")
    return first.float().square().mean()


IGNORE_INDEX = -100  # cross-entropy's default ignore_index: a target that counts no token


def _targets(flat: torch.Tensor) -> torch.Tensor | None:
    """The valid targets of a tensor of targets (integers, some of them IGNORE_INDEX), or None for any other."""
    if flat.is_floating_point() or flat.is_complex() or flat.dtype == torch.bool:
        return None
    ignored = flat == IGNORE_INDEX
    return flat[~ignored] if ignored.any() and not ignored.all() else None


def _piece(flat: torch.Tensor, valid: torch.Tensor | None, g: torch.Generator) -> torch.Tensor:
    """One microbatch's copy of a tensor: its values in a random order; a tensor of targets (`valid`: its valid
    targets), those drawn again for every position, then a fresh share (0 to 1) of them set to IGNORE_INDEX."""
    if valid is None:
        return flat[torch.randperm(flat.numel(), generator=g)]
    drawn = valid[torch.randint(valid.numel(), (flat.numel(),), generator=g, device=g.device)]
    share = torch.rand((), generator=g, device=g.device)
    return drawn.masked_fill(torch.rand(flat.numel(), generator=g, device=g.device) < share, IGNORE_INDEX)


def batch(args: tuple, kwargs: dict, pieces: int, step: int, seed: int) -> tuple[tuple, dict]:
    """A global batch of `pieces` copies of the example along dim 0 (one per dp slice and microbatch), each tensor's
    values in a random order, and a fresh mask of ignored targets in each piece of a tensor of targets (see the
    module docstring); tensors that were the same tensor stay the same tensor."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    made: dict[int, torch.Tensor] = {}

    def shuffled(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if id(x) not in made:
            flat = x.detach().reshape(-1)
            valid = _targets(flat)
            parts = [_piece(flat, valid, g) for _ in range(pieces)]
            if valid is not None and all(bool((p == IGNORE_INDEX).all()) for p in parts):
                parts[-1][-1] = valid[-1]  # at least one valid target in the whole batch (the last, which a shift
                # to next-token targets keeps)
            made[id(x)] = torch.cat([p.view_as(x) for p in parts]).requires_grad_(x.requires_grad)
        return made[id(x)]

    return pytree.tree_map(shuffled, (tuple(args), dict(kwargs)))


class Reference:
    """The unmodified model trained on one process, on the whole global batch at once: what step() must equal
    ([Note: whole-batch semantics] in passes/frontend/token_count.py: a token-mean loss is the mean over the global
    batch's valid targets, not the mean of the microbatches' means); in bf16, Megatron's recipe ([Tolerance])."""

    def __init__(self, model, loss, spec: CheckSpec):
        self.model, self.loss, self.spec = model, loss, spec
        self.low = torch.bfloat16 if spec.precision == "bf16" else None
        params = list(model.parameters())
        if self.low is not None:
            self.main = {p: p.detach().clone().requires_grad_(True) for p in params}  # fp32 main parameters
            model.to(self.low)
            params = list(self.main.values())
        self.opt = torch.optim.AdamW(params, lr=spec.lr)

    def step(self, args, kwargs) -> float:
        from fxpar.mixed_precision import cast_inputs, cast_outputs

        self.opt.zero_grad()
        if self.low is None:
            out = self.model(*args, **kwargs)
        else:
            out = cast_outputs(self.model(*cast_inputs(args, self.low), **cast_inputs(kwargs, self.low)))
        loss = self.loss(out, *args, **kwargs)
        loss.backward()
        if self.low is not None:  # bf16 gradients into fp32 main gradients
            for p, main in self.main.items():
                if p.grad is not None:
                    main.grad, p.grad = p.grad.float(), None
        self.opt.step()
        if self.low is not None:
            with torch.no_grad():
                for p, main in self.main.items():
                    p.copy_(main)
        return loss.item()

    def state(self) -> dict:
        return self.model.state_dict()


def relative(got: float, want: float) -> float:
    """|got - want| relative to max(1, |want|) ([Tolerance])."""
    return abs(got - want) / max(1.0, abs(want))


def _gap(full: dict, want: dict) -> tuple[float, str]:
    worst = (0.0, "")
    for key, w in want.items():
        if not w.is_floating_point():
            continue
        gap = ((full[key].to(w.dtype) - w).abs().max() / max(1.0, w.abs().max().item())).item()
        if gap > worst[0] or gap != gap:
            worst = (gap, key)
    return worst


def _on_rank(spec: CheckSpec) -> CheckResult:
    """One rank's part: parallelize, K steps beside the reference; what rank 0 reports."""
    from fxpar.api import parallelize
    from fxpar.mesh import init_mesh
    from fxpar.mixed_precision import MixedPrecision
    from fxpar.targets import load_factory

    factory = load_factory(spec.target)
    torch.manual_seed(spec.seed)
    model, args, kwargs, loss = unpack(factory(), spec.target)
    if spec.precision == "fp64":  # the arbiter ([Tolerance])
        _keep_float64()
        model.double()
        args, kwargs = pytree.tree_map(lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point()
                                       else x, (args, kwargs))
    loss = loss or default_loss
    reference = Reference(copy.deepcopy(model), loss, spec)
    note = _float64_experts(reference.model) if spec.precision == "fp64" else ""
    low = MixedPrecision(torch.bfloat16) if spec.precision == "bf16" else None
    config = spec.parallel_config(low)
    pm = parallelize(model, init_mesh(tp=spec.tp, pp=spec.pp, dp=spec.dp, ep=spec.ep), example_args=args,
                     example_kwargs=kwargs, loss_fn=lambda out, inputs: loss(out, *inputs[0], **inputs[1]),
                     config=config)
    opt = pm.optimizer(torch.optim.AdamW, lr=spec.lr)
    tol = TOLERANCE[spec.precision]
    result = CheckResult("exact", spec, bytes_per_element={"fp64": 8, "fp32": 4, "bf16": 2}[spec.precision],
                         tolerance=tol, reference_note=note)
    for step in range(spec.steps):
        b_args, b_kwargs = batch(args, kwargs, spec.dp * spec.m, step, spec.seed)
        opt.zero_grad()
        got = pm.step(*b_args, target=(b_args, b_kwargs), **b_kwargs).item()
        opt.step()
        want = reference.step(b_args, b_kwargs)
        gap, worst = _gap(pm.full_state_dict(), reference.state())
        result.steps.append(Step(got, want, gap, worst))
        loss_gap = relative(got, want)
        if not (loss_gap <= tol and (gap <= tol or low is not None)):  # bf16 parameters: not judged ([Tolerance])
            what = f"the loss differs by {loss_gap:.3g} (relative)" if not loss_gap <= tol else \
                f"parameter {worst} differs by {gap:.3g} (relative)"
            result.status, result.message = "mismatch", f"step {step}: {what}, above the {tol:g} bound"
            break
    result.ledger = list(pm.plan.comm)
    return result


def _float64_experts(model) -> str:
    """Hugging Face's `grouped_mm` experts call torch._grouped_mm, which refuses float64: the float64 reference runs
    the model's own `batched_mm` experts instead (the same per-expert products, batched), and the note says so."""
    config = getattr(model, "config", None)
    chosen = getattr(config, "_experts_implementation", None)
    if chosen in (None, "eager", "batched_mm") or not hasattr(model, "set_experts_implementation"):
        return ""
    model.set_experts_implementation("batched_mm")
    return f"the float64 reference runs Hugging Face's batched_mm experts ({chosen} refuses float64)"


def _keep_float64() -> None:
    """In this rank's process (the float64 arbiter's): `Tensor.float()` of a float64 tensor returns it unchanged."""
    upcast = torch.Tensor.float

    def at_least_fp32(self, memory_format=torch.preserve_format):
        return self if self.dtype == torch.float64 else upcast(self, memory_format=memory_format)

    torch.Tensor.float = at_least_fp32


def _classify(e: Exception) -> tuple[str, str]:
    """("refused", fxpar's message) for a clear refusal; ("failed", the traceback) for anything else."""
    from fxpar.trace import TraceError

    text = str(e)
    if isinstance(e, TraceError) or isinstance(e, (ValueError, TypeError, IndexError)) and "fxpar" in text:
        return "refused", text
    return "failed", traceback.format_exc()


def _worker(rank: int, spec: CheckSpec, folder: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(folder, "store"), spec.world)
    dist.init_process_group("gloo", rank=rank, world_size=spec.world, store=store,
                            timeout=timedelta(seconds=spec.timeout_s))
    try:
        result = _on_rank(spec)
    except Exception as e:
        status, message = _classify(e)
        result = CheckResult(status, spec, message=message)
    with open(os.path.join(folder, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def check(spec: CheckSpec) -> CheckResult:
    """Run the check on spec.world local processes: the worst rank's result. A fp32 mismatch is arbitrated in
    float64 ([Tolerance]): exact there, the result is exact and says so in `arbiter`. bf16: the bf16 run's losses,
    then the fp32 check of the same plan ([Tolerance])."""
    if spec.precision == "bf16":
        low = _run(spec)
        if low.status != "exact":
            return low
        result = check(dataclasses.replace(spec, precision="fp32"))
        result.spec, result.low_steps, result.bytes_per_element = spec, low.steps, low.bytes_per_element
        return result
    result = _run(spec)
    if result.status != "mismatch" or spec.precision == "fp64":
        return result
    wide = _run(dataclasses.replace(spec, precision="fp64"))
    if wide.status == "exact":
        result.status = "exact"
        result.arbiter = (f"fp32 {result.message}; the same run in float64 agrees to "
                          f"{max(s.gap for s in wide.steps):.2g} (bound {wide.tolerance:g}): rounding amplified by "
                          "AdamW near a zero gradient, not the rewrite"
                          + (f"; {wide.reference_note}" if wide.reference_note else ""))
        result.message = ""
        result.steps = wide.steps
    return result


def _run(spec: CheckSpec) -> CheckResult:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fxpar-check-") as folder:
        paths = [os.path.join(folder, f"rank{rank}.pkl") for rank in range(spec.world)]
        try:
            mp.start_processes(_worker, args=(spec, folder), nprocs=spec.world, start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            if not all(os.path.exists(p) for p in paths):  # died before its result (after it: at teardown)
                return CheckResult("failed", spec, message=f"a rank died outside the check: {e}")
        results = []
        for path in paths:
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    order = ["refused", "failed", "mismatch", "exact"]  # a refusal on one rank leaves the others waiting
    return min(results, key=lambda r: (order.index(r.status), results.index(r)))
