"""The loss owner: sums over predictions that add up exactly over any split of a batch, and bad losses named."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment
from gossamer.engine.batches import batch_samples, split_batch
from gossamer.engine.loss import EvalTotals, Objective

U = "tests.integration._user_regression"


def _mean_over_halves(obj: Objective, model: nn.Module, batch: object) -> torch.Tensor:
    """sum(loss) / (samples x predictions per sample), computed on two halves as two ranks would."""
    total = torch.zeros(())
    for part in range(2):
        piece = split_batch(batch, 2, part)
        total = total + obj.loss_sum(obj.forward(model, piece), piece)[0]
    n = batch_samples(batch)
    return total / (n * obj.per_sample(batch))


def test_mse_summed_over_two_halves_is_the_mean_over_every_output() -> None:
    torch.manual_seed(0)
    model, x, y = nn.Linear(4, 3), torch.randn(10, 4), torch.randn(10, 3)
    got = _mean_over_halves(Objective("mse"), model, (x, y))
    assert torch.allclose(got, F.mse_loss(model(x), y), atol=1e-6)


def test_user_loss_batch_mean_times_samples_adds_up_to_the_whole_batch_mean() -> None:
    from tests.integration._user_regression import half_squared_error, mlp

    torch.manual_seed(0)
    model, x, y = mlp(), torch.randn(11, 8), torch.randn(11)  # 11: uneven halves (6 + 5)
    got = _mean_over_halves(Objective(f"{U}:half_squared_error"), model, (x, y))
    assert torch.allclose(got, half_squared_error(model(x), y), atol=1e-6)


def test_sequence_cross_entropy_is_per_token_and_reports_perplexity() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 5), nn.Linear(5, 7))
    x, y = torch.randint(0, 7, (6, 4)), torch.randint(0, 7, (6, 4))
    obj = Objective()
    assert obj.per_sample((x, y)) == 4
    got = _mean_over_halves(obj, model, (x, y))
    want = F.cross_entropy(model(x).reshape(-1, 7), y.reshape(-1)).detach()
    assert torch.allclose(got, want, atol=1e-6)
    totals = EvalTotals(obj)
    totals.add(model(x), (x, y))
    m = totals.metrics()
    assert m["eval_loss"] == pytest.approx(float(want), rel=1e-5)
    assert m["eval_perplexity"] == pytest.approx(math.exp(float(want)), rel=1e-5) and "eval_accuracy" in m


def test_model_loss_reads_loss_from_a_mapping_and_calls_with_keywords() -> None:
    from tests.integration._user_regression import keyword_regressor

    torch.manual_seed(0)
    model = keyword_regressor()
    batch = {"features": torch.randn(8, 8), "labels": torch.randn(8)}
    obj = Objective("model")
    total, n = obj.loss_sum(obj.forward(model, batch), batch)
    assert n == 8 and torch.allclose(total / 8, model(**batch)["loss"])
    totals = EvalTotals(obj)
    totals.add(obj.forward(model, batch), batch)
    assert set(totals.metrics()) == {"eval_loss", "eval_perplexity"}  # no accuracy without classes


def test_regression_eval_reports_loss_only() -> None:
    obj = Objective("mse")
    totals = EvalTotals(obj)
    totals.add(torch.zeros(4), (torch.zeros(4, 2), torch.ones(4)))
    assert totals.metrics() == {"eval_loss": 1.0}


def test_cross_entropy_takes_logits_of_a_model_output_and_dict_batches_with_labels() -> None:
    class Out(dict):  # transformers' ModelOutput is a dict with attributes
        pass

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 4)

        def forward(self, features: torch.Tensor) -> Out:
            return Out(logits=self.lin(features))

    torch.manual_seed(0)
    model, batch = M(), {"features": torch.randn(5, 3), "labels": torch.randint(0, 4, (5,))}
    obj = Objective()
    total, k = obj.loss_sum(obj.forward(model, batch), batch)
    assert k == 5 and torch.allclose(total / 5, F.cross_entropy(model.lin(batch["features"]), batch["labels"]))


def test_a_loss_returning_per_sample_values_is_named() -> None:
    obj = Objective(f"{U}:per_sample_error")
    with pytest.raises(ConfigError, match="^loss: .*per_sample_error returned \\(4,\\).*scalar"):
        obj.loss_sum(torch.zeros(4), (torch.zeros(4, 2), torch.ones(4)))


def test_a_dict_batch_without_labels_is_named_for_a_target_loss() -> None:
    with pytest.raises(ConfigError, match="^dataset: .*'labels'"):
        Objective("mse").split({"features": torch.zeros(2)})


def test_model_loss_without_a_loss_in_the_output_is_named() -> None:
    obj = Objective("model")
    with pytest.raises(ConfigError, match="^loss: .*without a loss"):
        obj.loss_sum({"logits": torch.zeros(2, 3)}, {"x": torch.zeros(2)})


@pytest.mark.parametrize(("fields", "name"), [
    ({"loss": "hinge"}, "loss"), ({"loss": "not a path"}, "loss"), ({"collate": "nocolon"}, "collate"),
    ({"metrics": 3}, "metrics"), ({"num_workers": -1}, "num_workers"), ({"prefetch": 1.5}, "prefetch"),
    ({"loss": "model", "parallelism": "pipeline", "pipeline_microbatches": 4}, "loss"),
])
def test_experiment_refuses_bad_loss_and_data_fields_naming_them(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}:"):
        Experiment(name="e", model="m:f", dataset="d:g", **fields)  # type: ignore[arg-type]


def test_experiment_names_its_user_code_for_the_import_check() -> None:
    exp = Experiment(name="e", model="m:f", dataset="d:g", loss="mse", metrics="p.q:r")
    assert exp.code_paths() == {"model": "m:f", "dataset": "d:g", "metrics": "p.q:r"}
    assert Experiment(name="e", model="m:f", dataset="d:g", loss="p:l").code_paths()["loss"] == "p:l"


def test_a_batch_the_model_cannot_take_is_named_with_its_shape() -> None:
    obj = Objective("mse")
    with pytest.raises(ConfigError, match=r"^dataset: the model cannot take a batch of \(float32\[4, 3\], float32\[4\]\)"):
        obj.forward(nn.Linear(8, 1), (torch.zeros(4, 3), torch.zeros(4)))


@pytest.mark.parametrize(("dataset", "match"), [("not_a_pair", r"^dataset: .*\(train, eval\) pair"),
                                                ("not_datasets", r"^dataset: .*got int")])
def test_a_dataset_callable_returning_the_wrong_thing_is_named(dataset: str, match: str) -> None:
    from gossamer.engine.model import build, experiment_data

    exp = Experiment(name="e", model=f"{U}:linear", dataset=f"{U}:{dataset}")
    with pytest.raises(ConfigError, match=match):
        experiment_data(exp, *build(exp, torch.device("cpu"))[1:])


def test_user_metrics_that_raise_are_named_and_get_the_model_on_its_device() -> None:
    from gossamer.engine.model import user_metrics
    from tests.integration._user_regression import linear, stream_data

    model, (_, evalset) = linear(), stream_data(eval_n=50)
    exp = Experiment(name="m", model=f"{U}:linear", dataset=f"{U}:stream_data", loss="mse",
                     metrics=f"{U}:regression_metrics")
    got = user_metrics(exp, model, evalset)
    assert set(got) == {"eval_mae", "eval_r2"} and model.training  # back in training mode
    broken = Experiment(name="m", model=f"{U}:linear", dataset=f"{U}:stream_data", loss="mse",
                        metrics=f"{U}:half_squared_error")  # called as (model, eval set): raises
    with pytest.raises(ConfigError, match=r"^metrics: tests.integration._user_regression:half_squared_error raised "):
        user_metrics(broken, model, evalset)
    assert model.training
