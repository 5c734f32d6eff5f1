"""Every trainer option, declared once in trainer.options, reaches the run from every entry point:
the trainer's flags, a job config file, `scaletrain run` and `scaletrain chaos` (their flags, or
the file for what they shadow or set themselves); the Helm chart's side is in tests/helm. Bad
config files get one line naming the key; nothing starts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from scaletrain.app import cli
from scaletrain.app.commands.chaos import CHAOS_DEFAULTS, CHAOS_SHADOWED
from scaletrain.app.commands.launch import RUN_DEFAULTS, resolve_job
from trainer import options
from trainer.config import TrainConfig, from_args, from_values, parser
from trainer.data.prepare import PrepareOptions, prepare
from trainer.fp8.recipes import RECIPE_CHOICES
from trainer.model.moe import BALANCE_MODES
from trainer.options import BY_DEST, OPTIONS, Option
from trainer.parallel.dims import validate_layout
from trainer.parallel.pipeline import SCHEDULES

# A job on which every option has an effect: an MoE (the expert options count), in FP8 (the FP8
# options count).
BASE = {"run_id": "r", "n_experts": 8, "expert_groups": 2, "fp8": "tensorwise-delayed"}
# Values other than the default for options whose values have a syntax of their own.
SAMPLES: dict[str, options.Value] = {
    "inject_sdc": ("step=3,rank=0",),
    "inject_straggler": ("rank=0,delay=0.5",),
    "inject_loss_spike": ("step=2",),
    "inject_bad_device": ("rank=0",),
    "fp8_options": ("margin=1",),
    "ckptd": "127.0.0.1:1",
    "telemetry": "127.0.0.1:2",
}


# Options that act only beside another (that one's sample joins the base job).
NEEDS = {
    "document_masking": "data",
    "eval_every": "eval_data",
    "mem_ckpt_every": "ckptd",
    **dict.fromkeys(
        ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len"), "rope_scaling"
    ),
}


def base_of(o: Option) -> dict[str, options.Value]:
    """The base job for `o`: BASE, and the option `o` needs to act at all."""
    needed = NEEDS.get(o.dest)
    return BASE | ({needed: sample(BY_DEST[needed])} if needed else {})


@pytest.fixture(autouse=True, scope="module")
def prepared_data(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--data` takes a prepared directory (its tokenizer sizes the model): a tiny one."""
    text = tmp_path_factory.mktemp("text") / "a.txt"
    text.write_text("a few words of text " * 50)
    out = tmp_path_factory.mktemp("prepared")
    prepare(PrepareOptions(inputs=[str(text)], out=out))
    SAMPLES["data"] = str(out)
    # `--init-from-hf` takes a Hugging Face Llama directory (its config sizes the model).
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = tmp_path_factory.mktemp("hf")
    shape = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 1, "intermediate_size": 96, "vocab_size": 256}  # fmt: skip
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(hf)
    SAMPLES["init_from_hf"] = str(hf)


def sample(o: Option) -> options.Value:
    """A valid value of `o` that differs from the base job's."""
    current = BASE.get(o.dest, o.default)
    if o.dest in SAMPLES:
        return SAMPLES[o.dest]
    if o.kind is bool:
        return not current
    if o.choices:
        return next(c for c in o.choices if c != current)
    if o.kind is tuple:
        return ("layers.0",)
    if o.kind is str:
        return f"{current}-2"
    if o.kind is int:
        return current * 2 if current > 0 else current + 2
    return current * 2 if current else 0.5


def config(tmp_path: Path, values: dict[str, options.Value]) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(options.to_toml(values))
    return path


def train_config(argv: list[str]) -> TrainConfig:
    return from_args(parser().parse_args(argv))


@pytest.mark.parametrize("o", OPTIONS, ids=lambda o: o.dest)
def test_every_option_reaches_the_run_from_the_trainers_flags_and_from_a_config_file(
    o: Option, tmp_path: Path
) -> None:
    base = train_config(options.to_argv(base_of(o)))
    from_flag = train_config(options.to_argv(base_of(o) | {o.dest: sample(o)}))
    assert from_flag != base, f"{o.flag} changed nothing in the run's config"
    assert from_flag.job[o.dest] == sample(o)
    from_file = train_config(["--config", str(config(tmp_path, base_of(o) | {o.dest: sample(o)}))])
    assert from_file == from_flag and from_file.job == from_flag.job


@pytest.mark.parametrize("command", ["run", "chaos"])
def test_scaletrain_run_and_chaos_pass_every_option_on_or_take_it_from_the_config_file(
    command: str, tmp_path: Path
) -> None:
    defaults = RUN_DEFAULTS if command == "run" else CHAOS_DEFAULTS
    shadowed = CHAOS_SHADOWED if command == "chaos" else ()
    for o in OPTIONS:
        value = sample(o)
        base = {k: v for k, v in base_of(o).items() if k != "run_id"}
        try:
            if o.dest in shadowed:
                raise SystemExit(2)
            argv = options.to_argv(base | {o.dest: value})
            args = cli.build_parser().parse_args([command, *argv])
            reached = "by its flag"
        except SystemExit:
            # Set by the launcher itself (the stack's addresses) or shadowed by its own flag
            # (chaos --seed picks fault targets): the config file reaches it.
            path = config(tmp_path, base | {o.dest: value})
            args = cli.build_parser().parse_args([command, "--config", str(path)])
            reached = "by the config file"
        job = resolve_job(args, defaults)
        assert job[o.dest] == value, f"scaletrain {command} misses {o.flag} ({reached})"
        # The launcher adds its run id and its stack's ckptd.
        launched = ["--run-id", "r", "--ckptd", "127.0.0.1:1", *_handed_on(job)]
        passed = from_args(parser().parse_args(launched))
        if not o.launcher:
            assert passed.job[o.dest] == value, f"scaletrain {command} drops {o.flag}"


def _handed_on(job: dict[str, options.Value]) -> list[str]:
    return options.to_argv(options.passed_on(job))


def test_the_command_line_overrides_the_file_and_both_override_the_preset(tmp_path: Path):
    path = tmp_path / "job.toml"
    path.write_text('format_version = 1\n[model]\npreset = "llama3-8b"\nn_layers = 2\n'
                    "[optimizer]\nlr = 1e-4\n")  # fmt: skip
    cfg = train_config(["--run-id", "r", "--config", str(path), "--lr", "2e-4"])
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.ffn_dim, cfg.lr) == (4096, 2, 14336, 2e-4)


def test_print_config_prints_the_resolved_job_which_reads_back_to_the_same_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", "--print-config", "--preset", "moe-small", "--lr", "1e-3"]) == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    again = train_config(["--run-id", "r", "--config", str(printed)])
    assert again == train_config(["--run-id", "r", "--preset", "moe-small", "--lr", "1e-3"])
    assert again.job == options.resolve({"preset": "moe-small", "lr": 1e-3, "run_id": "r"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("format_version = 1\n[model]\ndimm = 3\n", "unknown key 'model.dimm'; [model] takes: "),
        (
            'format_version = 1\n[model]\ndim = "wide"\n',
            "--dim (model.dim): 'wide' is not allowed; allowed: an integer >= 1",
        ),
        (
            "format_version = 1\n[optimizer]\nlr = -1.0\n",
            "--lr (optimizer.lr): -1.0 is not allowed; allowed: a number > 0",
        ),
        (
            'format_version = 1\n[parallel]\npp_schedule = "zigzag"\n',
            "--pp-schedule (parallel.pp_schedule): 'zigzag' is not allowed; allowed: one of GPipe",
        ),
        (
            "format_version = 1\n[model\n",
            "not valid TOML: Expected ']' at the end of a table declaration (at line 2, column 7)",
        ),
        ("format_version = 2\n", "format_version 2; this trainer reads format_version = 1"),
        ("[model]\ndim = 64\n", "no format_version; this trainer reads format_version = 1"),
        (
            'format_version = 1\n[model]\npreset = "llama9"\n',
            "'llama9' is not allowed; allowed: one of debug, llama3-1b, llama3-8b",
        ),
    ],
)
def test_a_bad_config_file_gets_one_line_naming_the_key_and_starts_nothing(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(text)
    workdir = tmp_path / "w"
    assert cli.main(["run", "--config", str(path), "--workdir", str(workdir)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and message in lines[0] and str(path) in lines[0], lines
    assert not workdir.exists()


def test_an_accumulation_that_does_not_divide_the_batch_names_the_valid_values(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["run", "--ranks", "4", "--grad-accum-steps", "3", "--workdir", str(tmp_path / "w")]
    assert cli.main(argv) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "grad_accum_steps 3 does not divide the local batch 4" in line
    assert "valid grad_accum_steps: [1, 2, 4]; nearest valid global_batch: 12 or 24" in line


def test_the_options_choices_are_the_trainers_own() -> None:
    assert BY_DEST["fp8"].choices == RECIPE_CHOICES
    assert BY_DEST["pp_schedule"].choices == tuple(SCHEDULES)
    assert BY_DEST["moe_balance"].choices == BALANCE_MODES


def test_every_trainer_config_field_has_its_default_from_the_options() -> None:
    direct = TrainConfig(run_id="r")
    resolved = from_values(options.resolve({"run_id": "r"}))
    assert dataclasses.asdict(direct) | {"job": {}} == dataclasses.asdict(resolved) | {"job": {}}


def test_the_charts_values_schema_types_and_bounds_every_option_as_the_trainer_does() -> None:
    schema = json.loads(options.SCHEMA_FILE.read_text())
    assert schema["properties"]["trainer"]["properties"]["options"] == options.helm_schema(), (
        "run `python -m trainer.options` to update the chart's schema"
    )


def test_every_option_in_the_charts_values_reaches_the_trainers_command_line() -> None:
    import helm_python as helm

    given = {o.dest: sample(o) for o in OPTIONS if not o.launcher}
    with helm.Chart.load(options.SCHEMA_FILE.parent) as chart:
        files = chart.render(
            {"trainer": {"options": given}}, name="st", namespace="ml", is_install=True
        )
    manifests = [text for path, text in files.items() if path.endswith(".yaml")]
    docs = [d for text in manifests for d in yaml.safe_load_all(text) if d]
    (job,) = [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].endswith("trainer")]
    argv = job["spec"]["template"]["spec"]["containers"][0]["args"]
    trainer_argv = argv[argv.index("trainer") + 1 :]
    job_values = options.given(parser().parse_args(trainer_argv))
    assert {dest: job_values.get(dest) for dest in given} == given


@pytest.mark.parametrize(
    ("example", "world"),
    [("local.toml", 4), ("moe-2node.toml", 4), ("llama3-8b-h200-fp8.toml", 8)],
)
def test_the_example_configs_are_jobs_their_layouts_can_run(example: str, world: int) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / example
    validate_layout(train_config(["--run-id", "r", "--config", str(path)]), world)
