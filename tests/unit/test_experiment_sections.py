"""The Experiment's sections: every field in one, TOML tables equal to flat keys, clear refusals, and a fresh reference page."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment
from gossamer.core.experiment_sections import SECTIONS, field_doc, flatten, nest, section_of
from gossamer.core.modes import Mode, rows
from gossamer.tools.experiment_doc import render
from tests._doc_blocks import ROOT, blocks

REFERENCE = ROOT / "docs" / "experiment.md"
FIELDS = [f.name for f in dataclasses.fields(Experiment)]

#: Differs from the defaults in a field of every section, so a lost table would show.
_EXP = dict(name="t", model="m.a:b", dataset="m.a:c", total_steps=300, min_workers=2, model_args={"width": 8},
            batch_size=16, lr=0.1, momentum=0.9, num_ps_shards=2, staleness=3, compression="int8",
            compression_overrides={"*.bias": "none"}, eval_every=50, checkpoint_every=100, precision="bf16",
            profile_steps=2, start_timeout_s=30.0)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{k}" = {_toml(v)}' for k, v in value.items()) + "}"
    return repr(value)


def _write(path: Path, flat: dict[str, object], *, tables: bool) -> Path:
    if tables:
        text = "\n".join(f"[{s}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in t.items()) for s, t in nest(flat).items())
    else:
        text = "".join(f"{k} = {_toml(v)}\n" for k, v in flat.items())
    path.write_text(text)
    return path


def test_every_field_is_in_exactly_one_section_with_a_one_line_meaning() -> None:
    listed = [f.name for s in SECTIONS for f in s.fields]
    assert sorted(listed) == sorted(FIELDS), (
        f"fields without a section: {sorted(set(FIELDS) - set(listed))}; entries that are no field: "
        f"{sorted(set(listed) - set(FIELDS))} (gossamer/core/experiment_sections.py)")
    assert len(listed) == len(set(listed)), [n for n in listed if listed.count(n) > 1]
    for name in FIELDS:
        doc = field_doc(name)
        assert doc.help.strip() and "\n" not in doc.help, name
    assert all(s.fields and s.summary for s in SECTIONS)
    assert len({s.name for s in SECTIONS}) == len(SECTIONS)


def test_the_modes_of_a_field_are_a_flag_of_the_mode_table_true_somewhere() -> None:
    flags = {f.name for f in dataclasses.fields(Mode)} | {n for n, v in vars(Mode).items() if isinstance(v, property)}
    for name in FIELDS:
        modes = field_doc(name).modes
        if modes:
            assert modes in flags, (name, modes)
            assert all(isinstance(getattr(r, modes), bool) for r in rows()), (name, modes)
            assert any(getattr(r, modes) for r in rows()), (name, modes)


def test_no_section_shares_its_name_with_a_field_that_holds_a_table() -> None:
    types = {f.name: str(f.type) for f in dataclasses.fields(Experiment)}
    for s in SECTIONS:
        assert s.name not in types or not types[s.name].startswith(("dict", "list")), s.name


def test_a_toml_file_in_section_tables_reads_as_the_same_experiment_as_flat_keys(tmp_path: Path) -> None:
    flat = Experiment.from_toml(_write(tmp_path / "flat.toml", _EXP, tables=False))
    sectioned = Experiment.from_toml(_write(tmp_path / "tables.toml", _EXP, tables=True))
    assert sectioned == flat
    assert sectioned.lr == 0.1 and sectioned.model_args == {"width": 8} and sectioned.compression_overrides


def test_an_experiment_written_as_sections_reads_back_equal() -> None:
    exp = Experiment(**_EXP)  # type: ignore[arg-type]
    assert Experiment.from_dict(nest(exp.to_dict())) == exp
    assert set(nest(exp.to_dict())) == {s.name for s in SECTIONS}


def test_flat_keys_and_tables_mix_and_a_section_may_hold_its_namesake_field(tmp_path: Path) -> None:
    path = tmp_path / "mixed.toml"
    path.write_text('name = "t"\nmodel = "m.a:b"\ndataset = "m.a:c"\nlr = 0.2\n'
                    '[optimizer]\noptimizer = "adamw"\nweight_decay = 0.01\n'
                    '[compression]\ncompression = "bf16"\n')
    exp = Experiment.from_toml(path)
    assert (exp.optimizer, exp.lr, exp.weight_decay, exp.compression) == ("adamw", 0.2, 0.01, "bf16")


def test_a_dotted_override_beats_the_files_section(tmp_path: Path) -> None:
    path = _write(tmp_path / "tables.toml", _EXP, tables=True)
    assert Experiment.from_toml(path, overrides={"optimizer.lr": 0.3}).lr == 0.3
    assert Experiment.from_toml(path, overrides={"lr": 0.4}).lr == 0.4


def test_the_experiment_table_of_a_file_may_hold_sections(tmp_path: Path) -> None:
    path = tmp_path / "wrapped.toml"
    path.write_text('[experiment]\nname = "t"\n[experiment.data]\nmodel = "m.a:b"\ndataset = "m.a:c"\n'
                    'batch_size = 8\n')
    assert Experiment.from_toml(path).batch_size == 8


@pytest.mark.parametrize(("data", "field", "words"), [
    ({"optimiser": {"lr": 0.1}}, "optimiser", "unknown section; did you mean [optimizer]?"),
    ({"knobs": {"lr": 0.1}}, "knobs", "the sections are run, data"),
    ({"optimizer": {"lrr": 0.1}}, "optimizer", "unknown field 'lrr' in [optimizer]; did you mean 'lr'?"),
    ({"optimizer.lrr": 0.1}, "optimizer.lrr", "unknown field 'lrr' in [optimizer]"),
    ({"optimizer": {"batch_size": 8}}, "batch_size", "batch_size: belongs in [data], not [optimizer]"),
    ({"optimizer.batch_size": 8}, "batch_size", "belongs in [data]"),
    ({"lr": 0.1, "optimizer": {"lr": 0.2}}, "lr", "given twice, as a flat key and in [optimizer]"),
])
def test_a_key_in_the_wrong_place_or_given_twice_is_refused_naming_it(data: dict[str, object], field: str,
                                                                     words: str) -> None:
    with pytest.raises(ConfigError) as e:
        Experiment.from_dict({"name": "t", "model": "m.a:b", "dataset": "m.a:c", **data})
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_an_unknown_flat_key_is_still_named_by_the_experiment() -> None:
    with pytest.raises(ConfigError, match="did you mean 'lr'") as e:
        Experiment.from_dict({"name": "t", "model": "m.a:b", "dataset": "m.a:c", "lrr": 0.1})
    assert e.value.field == "lrr"


def test_flatten_leaves_a_table_valued_field_alone() -> None:
    assert flatten({"model_args": {"lr": 1}, "data": {"dataset_args": {"n": 2}}}) == {
        "model_args": {"lr": 1}, "dataset_args": {"n": 2}}
    assert section_of("model_args") == "data"


def test_the_reference_page_is_generated_from_the_sections() -> None:
    assert REFERENCE.read_text() == render(), (
        "docs/experiment.md is stale: run `python -m gossamer.tools.experiment_doc > docs/experiment.md`")


def test_the_reference_pages_example_file_is_a_valid_experiment(tmp_path: Path) -> None:
    (block,) = [b for b in blocks(REFERENCE) if b.mode == "file"]
    path = tmp_path / block.args
    path.write_text(block.text)
    exp = Experiment.from_toml(path)
    assert (exp.batch_size, exp.optimizer, exp.momentum) == (64, "sgd", 0.9)
