"""passes/joint on a simulated rank (no process group): the joint export of a chunk graph, the forward and backward
programs torch's partitioner cuts from it, and each layer's collectives read from them. The collectives name a
group that never runs, so these tests trace and read only; tests/test_joint_graph.py runs the programs over gloo."""
import expecttest
import pytest
import torch

from tests import models
from fxpar.compiler import Target, compile_model
from fxpar.config import Config
from fxpar.passes.joint.comm_table import collectives, program_comm
from fxpar.programs import JointRequest
from fxpar.runtime.joint_runner import JointRunner
from fxpar.passes.sharding.comm_audit import program_table
from fxpar.passes.tensor_parallel.collectives import TPComm


def _program(name: str, **config):
    model, args, kwargs = models.build(name)
    c = compile_model(model, args, kwargs, Target(TPComm(0, 2)), Config(joint_graph=True, **config))
    chunk = c.partition.chunks[0]
    assert isinstance(c.callables[chunk.index], JointRequest)
    return chunk.gm, JointRunner(chunk.gm, c.callables[chunk.index], c.config, 0).record


class TestJointExport(expecttest.TestCase):
    def test_every_collective_is_a_node_of_its_half(self):
        _, traced = _program("gpt")
        self.assertExpectedInline(str(collectives(traced.forward)), """\
[('all_reduce', 'tp_vocab_embedding_0'), ('all_reduce', 'tp_g_0'), ('all_reduce', 'tp_g_1'), ('all_reduce', 'tp_g_2'), ('all_reduce', 'tp_g_3'), ('all_gather', 'tp_gather_0')]""")
        self.assertExpectedInline(str(collectives(traced.backward)), """\
[('all_reduce', 'tp_f_4'), ('all_reduce', 'tp_f_3'), ('all_reduce', 'tp_f_2'), ('all_reduce', 'tp_f_1'), ('all_reduce', 'tp_f_0')]""")
        # each collective is waited for, in its own half
        for program in (traced.forward, traced.backward):
            waits = program.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.wait_tensor.default)
            assert len(waits) == len(collectives(program))

    def test_the_table_is_read_from_the_programs(self):
        gm, traced = _program("gpt")
        self.assertExpectedInline(program_table(program_comm([(gm, traced)])), """\
layers              forward program             backward program      GEMMs overlapped
------------------  --------------------------  ------------------  ------------------
h.0..1              2 all_reduce                2 all_reduce                         4
outside the layers  1 all_reduce, 1 all_gather  1 all_reduce                         1""")

    def test_sequence_parallel_programs(self):
        gm, traced = _program("gpt", sequence_parallel=True)
        rows = program_comm([(gm, traced)])
        inside = [r for r in rows if r.layer.startswith("h.")]
        assert [(sorted(r.forward), sorted(r.backward)) for r in inside] == [
            (["all_gather"] * 2 + ["reduce_scatter"] * 2,
             ["all_gather"] * 4 + ["all_reduce"] + ["reduce_scatter"] * 2)] * 2

    def test_a_llama_layer_is_megatrons(self):
        gm, traced = _program("llama_gqa")
        rows = [r for r in program_comm([(gm, traced)]) if r.layer != "outside the layers"]
        assert rows and all(r.forward == ("all_reduce",) * 2 and r.backward == ("all_reduce",) * 2 for r in rows)


def test_joint_graph_must_be_a_bool():
    with pytest.raises(ValueError, match="joint_graph must be True, False or None"):
        Config(joint_graph="yes")


def _hidden(program) -> list[str]:
    from fxpar.passes.joint.overlap import overlaps

    def op(n):
        return getattr(getattr(n.target, "overloadpacket", n.target), "__name__", str(n.target))

    return [f"{o.op} {o.node}: " + ", ".join(map(op, o.hidden)) for o in overlaps(program)]


class TestOverlapPasses(expecttest.TestCase):
    def test_traced_order_hides_nothing_behind_f(self):
        _, traced = _program("gpt", overlap=())
        self.assertExpectedInline("\n".join(_hidden(traced.backward)), """\
all_reduce tp_f_4: 
all_reduce tp_f_3: 
all_reduce tp_f_2: 
all_reduce tp_f_1: 
all_reduce tp_f_0: """)

    def test_early_collectives_and_late_waits_hide_the_weight_gradient(self):
        _, before = _program("gpt", overlap=())
        _, traced = _program("gpt")  # DEFAULT_OVERLAP: both passes
        program = traced.backward
        self.assertExpectedInline("\n".join(_hidden(program)), """\
all_reduce tp_f_4: t, t, t, detach, t, t, t, t, detach, t, t, mm, t, t
all_reduce tp_f_3: getitem, getitem, sum, view, t, mm, t, t, t, mm, t, sum, view, t
all_reduce tp_f_2: getitem, getitem, sum, view, t, mm, t, t, t, mm, t, sum, view, t
all_reduce tp_f_1: getitem, getitem, sum, view, t, mm, t, t, t, mm, t, sum, view, t
all_reduce tp_f_0: getitem, getitem, sum, view, t, mm, t, t, t, mm, t, sum, view, t""")
        # the same nodes, the collectives in the same order, every side effect in the same order
        names = [n.name for n in program.graph.nodes]
        assert sorted(names) == sorted(n.name for n in before.backward.graph.nodes)
        assert collectives(program) == collectives(before.backward)


class _Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + torch.rand_like(x)


def test_a_random_op_other_than_dropout_is_refused_with_the_node():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"cannot run this random op on fxpar's random streams yet: node rng_0 "
                                         r"\(the root module, on the replicated stream, aten.rand_like.default\).* Fix: "):
        compile_model(_Noisy(), (x,), {}, Target(TPComm(0, 2)), Config(joint_graph=True))
    c = compile_model(_Noisy(), (x,), {}, Target(TPComm(0, 2)), Config(compile=True))  # falls back, and says why
    assert not c.joint.on and "node rand_like" in c.joint.why and "aten.rand_like" in c.joint.why, c.joint.why


def test_dropout_noise_is_a_program_input():
    """[Note: random inputs]: each dropout of a chunk (and the fused bias-dropout-add) reads its noise from a
    placeholder of the program, in graph order, and no random op is left in the program."""
    from gpt import GPT, GPTConfig  # examples/ is on sys.path (tests/models.py)

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=8, layers=1, hidden=32, heads=4, dropout=0.1)).train()
    ids = torch.randint(0, 64, (2, 8))
    c = compile_model(model, (ids,), {}, Target(TPComm(0, 2)), Config(joint_graph=True))
    chunk = c.partition.chunks[0]
    record = JointRunner(chunk.gm, c.callables[chunk.index], c.config, 0).record
    noises = [n for n in record.gm.graph.find_nodes(op="placeholder") if n.name.endswith("_noise")]
    assert len(noises) == len(JointRunner(chunk.gm, c.callables[chunk.index], c.config, 0).noise) == 3
    # the attention probabilities' dropout (this rank's heads), then the two fused bias-dropout-adds
    assert [n.meta["fxpar_noise"].stream for n in noises] == ["sharded", "replicated", "replicated"]
    seeded = [n for n in record.joint.graph.nodes if n.op == "call_function"
              and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert not seeded, seeded


def test_overlap_needs_the_joint_graph_and_known_passes():
    with pytest.raises(ValueError, match="needs joint_graph=True"):
        Config(overlap=("late_waits",))
    with pytest.raises(ValueError, match="None or a tuple of pass names from"):
        Config(joint_graph=True, overlap=("sooner",))


def test_a_program_that_writes_memory_is_not_reordered():
    """late_waits would otherwise run a write (copy_ into an input) before a read that waits on a collective."""
    from fxpar.passes.joint.overlap import early_collectives, late_waits

    g = torch.fx.Graph()
    buf, x = g.placeholder("buf"), g.placeholder("x")
    started = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "fxpar-simulated-tp"))
    done = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (started,))
    read = g.call_function(torch.ops.aten.mul.Tensor, (buf, done))
    g.call_function(torch.ops.aten.copy_.default, (buf, x))
    g.output((read,))
    for program_pass in (early_collectives, late_waits):
        gm = torch.fx.GraphModule(torch.nn.Module(), g)
        before = [n.name for n in gm.graph.nodes]
        assert [n.name for n in program_pass(gm).graph.nodes] == before
