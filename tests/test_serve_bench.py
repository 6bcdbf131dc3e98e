"""`labrun bench serve` for real, at a small size: three real servers, the stdlib clients, the
ceiling, the free-model side and the figures derived from them (test_bench.py injects figures
to test the verdicts; this checks that the benchmark measures them)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from labrun import cli, models
from labrun.bench import serve as bench_serve


def test_bench_serve_runs_every_side_and_derives_its_figures(tmp_path, capsys):
    out = tmp_path / "serve.json"
    # 64 px and a few requests: the benchmark's path, not its figures.
    code = cli.main(["bench", "serve", "--requests", "24", "--clients", "4", "--rounds", "1",
                     "--image-size", "64", "--json", str(out)])
    assert code == 0  # no --check: misses are reported, not fatal
    result = json.loads(out.read_text())
    assert result["errors"] == 0 and result["client"] == "http.client"
    for side in ("served", "unbatched", "free_model", "direct"):
        assert result[side]["count"] == 24 and result[side]["per_s"] > 0, side
    served, ceiling = result["served"]["per_s"], result["ceiling"]["per_s"]
    by_way = result["ceiling"]["by_way"]
    assert set(by_way) == {"one call on every core", "one call per core at once"}
    assert ceiling == max(*(v for way in by_way.values() for v in way.values()),
                          result["direct"]["per_s"])
    bound = 1 / (1 / ceiling + 1 / result["free_model"]["per_s"])
    assert result["bound"]["per_s"] == pytest.approx(bound)
    assert result["ratio_to_bound"] == pytest.approx(served / bound)
    assert result["ratio_to_ceiling"] == pytest.approx(served / ceiling)
    assert set(result["latency"]) == {"1", "4"}
    table = capsys.readouterr().out
    assert " serve ratio_to_bound " in table and "... with a free model" in table


def test_the_free_models_work_is_a_thousandth_of_resnet18s():
    """The free-model side stands for everything a request costs but the model only because its
    model does next to nothing: counted here (torch's FLOP counter at the benchmark's 224 px),
    not timed, since two servers' req/s over 24 requests on loaded shared cores may come out
    either way whatever the models."""
    flops = {}
    for name, config in (("resnet18", bench_serve.RESNET18), ("free", bench_serve.FREE_MODEL)):
        model = models.build(OmegaConf.create(config), 1000).eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.zeros(1, 3, 224, 224))
        flops[name] = counter.get_total_flops()
    assert flops["resnet18"] > 3e9  # 1.8 G multiply-adds: the model is counted at all
    assert flops["free"] / flops["resnet18"] < 0.002, flops  # measured: 0.1%
