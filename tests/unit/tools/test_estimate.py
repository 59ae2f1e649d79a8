import pytest

from shardwise.cli import main as cli_main
from shardwise.tools.estimate import all_settings, count_params, estimate

PSI, N = 1_000_000, 8


@pytest.mark.parametrize("dtype,p,g,o", [("fp32", 4, 4, 8), ("fp16", 2, 2, 12), ("bf16", 2, 2, 12)])
def test_stages_match_the_closed_form(dtype, p, g, o):
    def device(stage):
        return estimate(PSI, devices_per_node=4, num_nodes=2, dtype=dtype, stage=stage).device_bytes

    assert device(0) == (p + g + o) * PSI
    assert device(1) == (p + g) * PSI + o * PSI / N
    assert device(2) == p * PSI + (g + o) * PSI / N
    assert device(3) == pytest.approx((p + g + o) * PSI / N)
    assert device(0) > device(1) > device(2) > device(3)


def test_offload_moves_states_to_cpu():
    plain = estimate(PSI, devices_per_node=4, num_nodes=2, dtype="fp16", stage=2)
    off = estimate(PSI, devices_per_node=4, num_nodes=2, dtype="fp16", stage=2, offload_optimizer=True)
    assert off.device_bytes == plain.device_bytes - 12 * PSI / N
    assert off.cpu_bytes_per_node == 12 * PSI / N * 4
    full = estimate(
        PSI, devices_per_node=4, num_nodes=2, dtype="fp16", stage=3, offload_optimizer=True, offload_param=True
    )
    assert full.device_bytes == 0 and full.cpu_bytes_per_node == pytest.approx(16 * PSI / N * 4)
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        estimate(PSI, stage=2, offload_param=True)
    assert len(all_settings(PSI)) == 8


def test_count_params_on_meta_device_counts_tied_weights_once():
    assert count_params("shardwise.testing.models:TinyMLP", {"vocab": 10, "width": 4}) == 10 * 4 + 2 * 4 + (
        4 * 8 + 8
    ) + (8 * 4 + 4)


def test_cli_estimate_and_report(capsys):
    assert cli_main(["estimate", "--params", "1.5b", "--num_gpus", "8", "--device_memory", "16g"]) == 0
    out = capsys.readouterr().out
    assert "1500.0M parameters" in out and "| 0 | none | 22.35 GiB | 0.00 GiB | no |" in out
    assert cli_main(["estimate", "--model", "nowhere:Model"]) == 2
    assert "cannot import 'nowhere:Model'" in capsys.readouterr().err
    assert cli_main(["report"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "gloo" in out and "cpu count" in out
    assert cli_main(["bogus"]) == 2
