"""Config loading: overrides, type checks, cross-field rules, phase budgets; the CLI's exit 2."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml
from jobs import REPO

from megatron_mlmclm.cli import COMMANDS, main
from megatron_mlmclm.config import (
    PhaseConfig,
    RunConfig,
    dump_yaml,
    load_config,
    phase_at,
    resolve_phase_steps,
)
from megatron_mlmclm.errors import UsageError

MOCK = ["data.mock=true"]


def test_defaults_fill_the_preset():
    cfg = load_config(None, MOCK + ["model.preset=610m"])
    m = cfg.model
    assert (
        m.num_layers,
        m.hidden_size,
        m.ffn_hidden_size,
        m.num_attention_heads,
        m.num_query_groups,
        m.kv_channels,
        m.seq_length,
    ) == (26, 1152, 4096, 18, 6, 64, 2048)
    assert cfg.checkpoint.dir.endswith("checkpoints")


def test_overrides_parse_yaml_values_and_list_indices(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "phases": [
                    {"objective": "clm", "share": 0.25},
                    {"objective": "mlm", "share": 0.75},
                ],
                "train": {"steps": 42000, "warmup_steps": 2000, "decay_steps": 2000},
                "data": {"train": ["x"]},
            }
        )
    )
    cfg = load_config(
        path,
        [
            "phases.1.mask_ratio=0.3",
            "train.lr=3e-4",
            "model.preset=tiny",
            "data.train=[0.5, a, 0.5, b]",
        ],
    )
    assert cfg.phases[1].mask_ratio == 0.3 and cfg.train.lr == 3e-4
    assert [p.steps for p in cfg.phases] == [10500, 31500]
    assert cfg.data.train == ["0.5", "a", "0.5", "b"]


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model.hiden_size=3"], "unknown config key 'model.hiden_size'"),
        (["train.steps=ten"], "'train.steps' must be an integer"),
        (["model.hidden_size=130"], "must divide model.hidden_size"),
        (["parallel.tensor_model_parallel_size=4"], "must divide model.num_query_groups"),
        (["parallel.tensor_model_parallel_size=3"], "must divide model.num_attention_heads"),
        (["parallel.pipeline_model_parallel_size=8"], "larger than model.num_layers"),
        (["phases.0.mask_ratio=1.0"], "mask_ratio 1.0 must be in (0, 1)"),
        (
            ["phases=[{objective: clm, share: 0.3}, {objective: mlm, share: 0.6}]"],
            "must sum to the budget",
        ),
        (["phases.0.objective=bert"], "objective 'bert'"),
        (
            ["train.global_batch_size=6", "train.micro_batch_size=4"],
            "must divide train.global_batch_size",
        ),
        (["train.warmup_steps=80", "train.decay_steps=30"], "must fit in train.steps"),
        (["model.preset=huge"], "model.preset 'huge' is unknown"),
        (["data.mock=false"], "data.train is empty"),
        (["train.steps"], "must look like key.sub=value"),
        (["checkpoint.move_aside_existing=true"], "applies to a fresh start only"),
        (
            ["phases=[{objective: clm, share: 0.5, steps: 40}, {objective: mlm, share: 0.5}]"],
            "phases.0 gives share 0.5 (= 50 of train.steps=100) and steps 40, which disagree",
        ),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(UsageError) as e:
        load_config(None, MOCK + overrides)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


# Pairs that contradict each other (one would be silently ignored): refused in one line naming both.
@pytest.mark.parametrize(
    "overrides,one_alone,first,second",
    [
        (["data.train=[shards/a_text_document]"], [], "data.mock=true", "data.train"),
        (["data.valid=[shards/v_text_document]"], [], "data.mock=true", "data.valid"),
        (
            ["data.mock=false", "data.train=[a]", "logging.eval_interval=10"],
            ["data.mock=false", "data.train=[a]"],
            "logging.eval_interval=10",
            "data.valid is empty",
        ),
        (
            ["train.fp8=delayed", "train.precision=fp32"],
            ["train.fp8=delayed"],
            "train.fp8=delayed",
            "train.precision=fp32",
        ),
        (
            ["checkpoint.allow_data_change=true", "checkpoint.resume=false"],
            ["checkpoint.allow_data_change=true"],
            "checkpoint.allow_data_change=true",
            "checkpoint.resume=false",
        ),
        (
            ["checkpoint.allow_shifted_optimizer_state=true", "checkpoint.resume=false"],
            ["checkpoint.allow_shifted_optimizer_state=true"],
            "checkpoint.allow_shifted_optimizer_state=true",
            "checkpoint.resume=false",
        ),
        (
            ["parallel.overlap_param_gather=true"],
            [],
            "parallel.overlap_param_gather=true",
            "parallel.use_distributed_optimizer=false",
        ),
        (
            [
                "parallel.use_distributed_optimizer=true",
                "parallel.overlap_param_gather=true",
                "parallel.overlap_grad_reduce=false",
            ],
            ["parallel.use_distributed_optimizer=true", "parallel.overlap_param_gather=true"],
            "parallel.overlap_param_gather=true",
            "parallel.overlap_grad_reduce=false",
        ),
        (
            ["train.fp8=delayed", "parallel.context_parallel_size=2"],
            ["parallel.context_parallel_size=2"],
            "train.fp8=delayed",
            "context_parallel_size=2",
        ),
    ],
)
def test_contradictory_settings_are_refused_naming_both(overrides, one_alone, first, second):
    with pytest.raises(UsageError) as e:
        load_config(None, MOCK + overrides)
    msg = str(e.value)
    assert first in msg and second in msg and "\n" not in msg
    load_config(None, MOCK + one_alone)  # either setting alone is accepted


def test_tiny_yaml_with_shards_on_the_command_line_exits_2_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "pretrain",
                str(REPO / "examples/configs/tiny.yaml"),
                "data.train=[my_shards]",
                f"output_dir={out}",
            ]
        )
        == 2
    )
    assert "data.mock=false" in capsys.readouterr().err
    assert not out.exists()


def test_phase_steps_sum_exactly_and_zero_share_phases_are_skipped():
    phases = [
        PhaseConfig("clm", share=1 / 3),
        PhaseConfig("mlm", share=1 / 3),
        PhaseConfig("mlm", share=1 / 3, mask_ratio=0.2),
    ]
    assert sum(resolve_phase_steps(phases, 100)) == 100
    phases = [PhaseConfig("clm", share=0.0), PhaseConfig("mlm", share=1.0)]
    assert resolve_phase_steps(phases, 12) == [0, 12]
    assert phase_at(phases, 0)[0] == 1
    phases = [PhaseConfig("clm", steps=10), PhaseConfig("mlm", share=0.5)]
    assert resolve_phase_steps(phases, 20) == [10, 10]
    assert [phase_at(phases, s)[1].objective for s in (0, 9, 10, 19)] == [
        "clm",
        "clm",
        "mlm",
        "mlm",
    ]


def test_one_phase_without_a_length_takes_the_rest_of_the_budget():
    """CLM for an absolute length, MLM for whatever the budget leaves: a budget change moves only
    the last phase's end (what a decay branch needs)."""
    phases = "phases=[{objective: clm, steps: 30}, {objective: mlm}]"
    for steps in (40, 100):
        cfg = load_config(None, MOCK + [phases, f"train.steps={steps}"])
        assert [p.steps for p in cfg.phases] == [30, steps - 30]
    # in tokens: the tiny preset reads 8 x 128 = 1,024 tokens a step
    cfg = load_config(
        None,
        MOCK
        + [
            "phases=[{objective: clm, tokens: 10240}, {objective: mlm}]",
            "train.steps=null",
            "train.tokens=40960",
        ],
    )
    assert [p.steps for p in cfg.phases] == [10, 30] and cfg.train.steps == 40
    with pytest.raises(UsageError, match="phases.0 and phases.1 give no length"):
        load_config(None, MOCK + ["phases=[{objective: clm}, {objective: mlm}]"])
    with pytest.raises(UsageError, match="other than phases.1 take more than the budget"):
        load_config(None, MOCK + [phases, "train.steps=20"])


def test_dumped_and_dry_run_configs_load_back_unchanged(tmp_path, placeholder_dry_run):
    """A run's config.yaml and the --dry-run output are valid configs of the same run."""
    src = tmp_path / "c.yaml"
    src.write_text(
        yaml.safe_dump(
            {
                "data": {"train": ["t1"], "valid": ["0.3", "v1", "0.7", "v2"]},
                "train": {"steps": 31, "warmup_steps": 3, "decay_steps": 3, "lr": "5e-4"},
                "phases": [
                    {"objective": "clm", "share": 1 / 3},
                    {"objective": "mlm", "steps": 10},
                    {
                        "objective": "mlm",
                        "share": 1 - 1 / 3 - 10 / 31,
                        "mask_ratio": 0.2,
                        "mask_replace": "80-10-10",
                    },
                ],
            }
        )
    )
    cfg = load_config(src, ["model.preset=610m", "checkpoint.allow_data_change=true"])
    # Resolved: shares and steps side by side (what used to be refused on reload).
    assert [(p.share, p.steps) for p in cfg.phases] == [
        (1 / 3, 10),
        (None, 10),
        (1 - 1 / 3 - 10 / 31, 11),
    ]
    dump_yaml(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    out = placeholder_dry_run(str(src), "model.preset=610m", "checkpoint.allow_data_change=true")
    (tmp_path / "dry.yaml").write_text(out)
    assert load_config(tmp_path / "dry.yaml") == cfg


def test_cli_bad_config_exits_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: [1, 2]\n")
    assert main(["pretrain", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not valid YAML" in err
    assert main(["pretrain", str(tmp_path / "missing.yaml")]) == 2
    assert main(["pretrain", "data.mock=true", "model.num_attention_heads=5"]) == 2
    assert main(["frobnicate"]) == 2


def test_every_subcommand_has_help(capsys):
    for name, (module, _) in COMMANDS.items():
        import importlib.util

        if importlib.util.find_spec(module) is None:
            continue  # an optional command whose module is absent
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        assert f"mlmclm {name}" in capsys.readouterr().out


def test_version_is_the_changelogs_newest_release(capsys):
    """`mlmclm --version` names the newest released version in CHANGELOG.md (Keep a Changelog
    headings), so the version cannot move without the changelog saying what changed."""
    import re

    released = re.findall(
        r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$",
        (REPO / "CHANGELOG.md").read_text(),
        flags=re.M,
    )
    assert released, "CHANGELOG.md has no '## [x.y.z] - YYYY-MM-DD' release heading"
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"mlmclm {released[0]} (megatron-core "), out


def _allow_keys(cls, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: (type, default)} of every `allow_*` setting of a config schema, sections and
    list items (written `N`) included."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        if f.name.startswith("allow_"):
            out[key] = (tp, f.default)
        args = typing.get_args(tp)
        if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
            out |= _allow_keys(args[0], f"{key}.N.")
        for inner in [a for a in (tp, *args) if dataclasses.is_dataclass(a)]:
            out |= _allow_keys(inner, key + ".")
    return out


def test_the_risk_table_lists_every_allow_key_of_the_schema():
    """docs/pretrain.md's "Accepting a risk" table has one row per `allow_*` key of the run
    config, no more and no fewer, so a new way to lift a check cannot land without its row; each
    is a boolean, false by default, as the page says."""
    import re

    schema = _allow_keys(RunConfig)
    assert schema, "no allow_* key found: the schema walk is broken"
    for key, (tp, default) in schema.items():
        assert tp is bool and default is False, f"{key}: not a bool, false by default"
    page = (REPO / "docs" / "pretrain.md").read_text()
    section = page.split("\n## Accepting a risk\n", 1)[1].split("\n## ", 1)[0]
    switches = [
        line.strip().strip("|").split("|")[0].strip()
        for line in section.splitlines()
        if line.startswith("|")
    ][2:]  # past the header and its rule
    documented = []
    for cell in switches:
        documented += re.findall(r"`([\w.]*\ballow_\w+)=true`", cell)
    assert len(documented) == len(set(documented)), f"a key listed twice: {documented}"
    assert sorted(documented) == sorted(schema), (
        f"table lacks {sorted(set(schema) - set(documented))}, "
        f"lists keys not in the schema {sorted(set(documented) - set(schema))}"
    )
