"""cost.fit: the calibration fits recover the parameters that generated their data, and say why they cannot."""
import dataclasses

import pytest

from fxpar.cost.cluster import Cluster
from fxpar.cost.compute import layer_seconds
from fxpar.cost.fit import fit_compute, fit_latency_bandwidth
from fxpar.cost.shape import ModelShape

CPU = Cluster(name="cpu", peak_flops=60e9, memory_bytes=8e9, memory_bandwidth=20e9, gpus_per_node=2,
              intra_bandwidth=1e9, intra_latency=1e-3, inter_bandwidth=1e9, inter_latency=1e-3, gemm_efficiency=1.0,
              memory_efficiency=1.0, link_efficiency=1.0, dtype_bytes=4)
LADDER = [(1, 16, 32, 2, 1), (2, 128, 128, 8, 1), (4, 128, 256, 8, 1), (4, 128, 512, 8, 1), (4, 128, 256, 8, 2)]


def test_latency_and_bandwidth_recovered_exactly():
    sizes = [1e3, 1e5, 1e6, 1e7]
    latency, bandwidth = fit_latency_bandwidth(sizes, [2e-5 + s / 3e9 for s in sizes])
    assert latency == pytest.approx(2e-5) and bandwidth == pytest.approx(3e9)


def test_relative_error_lets_small_messages_set_the_latency():
    """A 30% slow outlier at 32 MiB must not move the latency much (plain least squares gives 0.73 ms)."""
    sizes = [2 ** k for k in range(10, 26, 3)]
    seconds = [1e-3 + s / 1e9 for s in sizes]
    seconds[-1] *= 1.3
    latency, _ = fit_latency_bandwidth(sizes, seconds)
    assert latency == pytest.approx(1e-3, rel=0.1)


def test_negative_intercept_is_refit_through_the_origin():
    latency, bandwidth = fit_latency_bandwidth([1e3, 1e6], [0.5e-6, 1e-3])
    assert latency == 0.0 and 0.9e9 < bandwidth < 2.1e9


def test_latency_fit_errors_show_the_data():
    with pytest.raises(ValueError, match=r"does not grow with size \(\[\(1, 3\)"):
        fit_latency_bandwidth([1, 2, 3], [3, 2, 1])
    with pytest.raises(ValueError, match="at least 2"):
        fit_latency_bandwidth([1], [1.0])
    with pytest.raises(ValueError, match="must be > 0"):
        fit_latency_bandwidth([1, 2], [0.0, 1.0])


def samples_from(cluster):
    out = []
    for b, s, h, a, t in LADDER:
        shape = ModelShape(layers=1, hidden=h, heads=a, seq=s, vocab=1, batch=b)
        one = layer_seconds(shape, b, t, cluster)
        out.append((shape, b, t, one.forward + one.backward))
    return out


@pytest.mark.parametrize("efficiency, overhead", [(0.4, 20e-6), (0.85, 3e-6), (1.0, 0.0)])
def test_compute_fit_recovers_efficiency_and_overhead(efficiency, overhead):
    truth = dataclasses.replace(CPU, gemm_efficiency=efficiency, kernel_overhead=overhead)
    fitted, rms = fit_compute(samples_from(truth), CPU)
    assert fitted.gemm_efficiency == pytest.approx(efficiency, rel=0.03)  # the grid's step is 2.3%
    assert fitted.kernel_overhead == pytest.approx(overhead, rel=0.1, abs=0.5e-6)
    assert rms < 0.02
    assert (fitted.peak_flops, fitted.memory_bandwidth) == (CPU.peak_flops, CPU.memory_bandwidth)


def test_compute_fit_reports_a_poor_fit():
    """Times the model cannot produce (flat in size) fit badly, and the rms error says so."""
    samples = [(shape, b, t, 0.01) for shape, b, t, _ in samples_from(CPU)]
    _, rms = fit_compute(samples, CPU)
    assert rms > 0.3


def test_compute_fit_needs_two_sizes():
    with pytest.raises(ValueError, match=">= 2 measured sizes, got 1"):
        fit_compute(samples_from(CPU)[:1], CPU)
