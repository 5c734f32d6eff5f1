"""Every trainer option, declared once: flag, TOML key, type, default, allowed values, help.

Everything else is derived from `OPTIONS`: the trainer's argparse (`python -m trainer`), what
`scaletrain run`, `scaletrain chaos` and `scaletrain plan` accept and pass through, the job config
file (`--config job.toml`, one section per concern), `--print-config`, the Helm chart's
`trainer.options` schema, and the list of changes a resume refuses. A new option is one entry
here plus where the trainer uses it; no entry point can miss it (tests/trainer/test_options.py).

No torch here: `scaletrain` parses, resolves and checks a job before any process starts.

Resolution, lowest first: the option's default, the model preset (`--model`), the config file,
the command line. Every value is checked here (type, range, choices) and reported in one line that
names the flag and the key; the checks that relate options (a layout, an FP8 recipe) stay where
they are made (trainer/config.py, trainer/parallel/dims.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.health import POLICIES, QUARANTINE_POLICIES
from trainer.model.presets import PRESETS, preset

# The ranks an elastic job has at its full size (`--nodes MIN:MAX`: MAX's), set by its launcher
# (the embedded stack, the Helm chart) in every rank's environment.
FULL_WORLD_ENV = "SCALETRAIN_FULL_WORLD"
# The version of the job config format; a file for another one is refused.
FORMAT_VERSION = 1
# TOML sections in the order --print-config writes them ("" is the top level).
SECTIONS = (
    "",
    "model",
    "parallel",
    "fp8",
    "optimizer",
    "schedule",
    "data",
    "checkpoint",
    "health",
    "telemetry",
)
Value = int | float | str | bool | tuple[str, ...]


@dataclass(frozen=True)
class Option:
    """One option. `dest` names it in Python and on the command line (`--` + dest with dashes);
    `key` is its name in `section` of the config file (default: dest)."""

    dest: str
    section: str
    kind: type  # int, float, str, bool, or tuple (a list of strings)
    default: Value
    help: str
    key: str = ""
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    # True: values must exceed `minimum`; False: may equal it.
    exclusive: bool = False
    # Changing it changes what a run computes: a resume with another value is refused.
    alters_results: bool = False
    # A list option given as a repeated flag (--fp8-option A --fp8-option B), not "A,B".
    repeated: bool = False
    # Set by `scaletrain run`/`chaos` themselves (their own flag, or the stack's address).
    launcher: bool = False
    # The flag when it is not `--` + dest with dashes (a repeated flag names one item).
    flag_name: str = ""
    # The flag's former name, kept working for one release with a notice (`Renamed`).
    old_flag: str = ""
    # A rule another service applies to the value too, called with a non-empty value and
    # `where`: it raises scaletrain.errors.InvalidArgument in that service's words.
    rule: Callable[[str, str], object] | None = None

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.dest.replace("_", "-")

    @property
    def toml_key(self) -> str:
        return self.key or self.dest

    @property
    def where(self) -> str:
        """How an error names the option: its flag and its place in the config file."""
        dotted = f"{self.section}.{self.toml_key}" if self.section else self.toml_key
        return f"{self.flag} ({dotted})"

    def allowed(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        bound = ""
        if self.minimum is not None:
            bound = f" {'>' if self.exclusive else '>='} {self.minimum:g}"
        return {
            int: "an integer",
            float: "a number",
            str: "a string",
            bool: "true or false",
            tuple: "a list of strings",
        }[self.kind] + bound

    def check(self, value: object) -> Value:
        """`value` as this option's type; ValueError naming the option, the value and what is
        allowed. Accepts what TOML and argparse produce: ints for floats, lists for tuples."""
        bad = ValueError(f"{self.where}: {value!r} is not allowed; allowed: {self.allowed()}")
        if self.kind is bool:
            if not isinstance(value, bool):
                raise bad
            return value
        if self.kind is tuple:
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise bad
            return tuple(value)
        accepted = (int, float) if self.kind is float else (self.kind,)
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise bad
        if self.kind is float:
            value = float(value)
            if not math.isfinite(value):
                raise bad
        if self.choices and value not in self.choices:
            raise bad
        if self.minimum is not None and (
            value < self.minimum or (self.exclusive and value == self.minimum)
        ):
            raise bad
        if self.rule is not None and value:
            from scaletrain.errors import InvalidArgument

            try:
                self.rule(str(value), self.where)
            except InvalidArgument as exc:
                raise ValueError(str(exc)) from None
        return value


def _run_id_rule(value: str, where: str) -> None:
    """The run-id rule of ckptd and telemetry (`scaletrain.names`), so that a run id they would
    refuse at the first save or report is refused before anything starts. Imported when a run
    id is given: the rule's module brings gRPC and protobuf, which this module does without."""
    from scaletrain.names import check_run_id

    check_run_id(value, where)


def _model(dest: str, kind: type, help: str, **kw: object) -> Option:
    """A model-shape option: its default is the debug preset's value."""
    default = PRESETS["debug"].get(dest, kw.pop("default", 0))
    return Option(dest, "model", kind, default, help, alters_results=True, **kw)  # type: ignore[arg-type]


# Names whose meaning lives in modules that import torch (trainer.fp8.recipes.RECIPE_CHOICES,
# trainer.parallel.pipeline.SCHEDULES, trainer.model.moe.BALANCE_MODES); a test holds them equal.
RECIPE_CHOICES = ("none", "tensorwise-delayed", "tensorwise", "blockwise", "mxfp8")
PP_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
BALANCE_MODES = ("aux_free", "aux_loss", "none")
DECAYS = ("constant", "linear", "cosine", "wsd")
FAULT_METAVARS = {
    "inject_sdc": "step=K,rank=R[,target=TARGET][,bit=B|bits=CLASS][,element=largest|random]"
    "[,seed=S]",
    "inject_straggler": "rank=R,delay=SECONDS",
    "inject_loss_spike": "step=K",
    "inject_bad_device": "rank=R",
}

OPTIONS: tuple[Option, ...] = (
    # The job itself (top level of the file).
    Option(
        "run_id",
        "",
        str,
        "",
        "name of the run (checkpoints and telemetry); required",
        launcher=True,
        rule=_run_id_rule,
    ),
    Option(
        "seed", "", int, 1234, "seed of the initial weights and the data order", alters_results=True
    ),
    Option("log_every", "", int, 10, "steps between log lines", minimum=1),
    # [model]
    Option(
        "preset",
        "model",
        str,
        "debug",
        "a model preset (the job file's model.preset); the model options below override it",
        choices=tuple(PRESETS),
        alters_results=True,
        old_flag="--model",
    ),
    _model("dim", int, "model width", minimum=1),
    _model("n_layers", int, "transformer blocks", minimum=1),
    _model("n_heads", int, "attention heads", minimum=1),
    _model("n_kv_heads", int, "key/value heads (grouped-query attention)", minimum=1),
    _model("vocab_size", int, "vocabulary size (256: the byte corpus)", minimum=256),
    _model(
        "multiple_of", int, "the SwiGLU hidden size is rounded up to a multiple of this", minimum=1
    ),
    _model(
        "ffn_dim_multiplier",
        float,
        "scales the SwiGLU hidden size before rounding (0: none)",
        minimum=0,
    ),
    _model(
        "rope_theta", float, "base of the rotary embedding's frequencies", minimum=0, exclusive=True
    ),
    _model(
        "rope_scaling",
        float,
        "Llama 3.1's RoPE scaling for long context: low frequencies divided by this, high ones "
        "kept, a ramp between (0: none; Llama 3.1/3.3: 8, 3.2: 32)",
        minimum=0,
    ),
    _model(
        "rope_low_freq_factor",
        float,
        "with --rope-scaling: wavelengths above rope_original_max_len / this are scaled",
        default=1.0,
        minimum=0,
        exclusive=True,
    ),
    _model(
        "rope_high_freq_factor",
        float,
        "with --rope-scaling: wavelengths below rope_original_max_len / this are kept",
        default=4.0,
        minimum=0,
        exclusive=True,
    ),
    _model(
        "rope_original_max_len",
        int,
        "with --rope-scaling: the context length the model was pretrained at",
        default=8192,
        minimum=1,
    ),
    _model("max_seq_len", int, "longest sequence the rotary tables cover", minimum=1),
    _model("norm_eps", float, "RMSNorm epsilon", minimum=0, exclusive=True),
    _model("n_experts", int, "routed experts in every block (0: dense feed-forward)", minimum=0),
    _model("top_k", int, "experts each token goes through", default=2, minimum=1),
    _model(
        "shared_experts", int, "experts every token goes through besides its routed ones", minimum=0
    ),
    _model("moe_hidden", int, "each expert's hidden size (0: the dense feed-forward's)", minimum=0),
    _model(
        "capacity_factor",
        float,
        "expert capacity factor (0: never drop tokens)",
        default=0.0,
        minimum=0,
    ),
    _model("moe_balance", str, "expert load balancing", default="aux_free", choices=BALANCE_MODES),
    _model(
        "expert_groups",
        int,
        "groups of consecutive experts (e.g. one per node)",
        default=1,
        minimum=1,
    ),
    _model(
        "topk_groups",
        int,
        "each token's experts come from at most this many groups",
        default=1,
        minimum=1,
    ),
    # [parallel]: world = dp_replicate * dp_shard * cp * tp * pp
    Option(
        "dp_replicate",
        "parallel",
        int,
        1,
        "data-parallel replicas (HSDP's replicate degree; -1: the ranks the other degrees "
        "leave, for an elastic HSDP job that loses a replica with a node)",
        minimum=-1,
    ),
    Option(
        "dp_shard",
        "parallel",
        int,
        -1,
        "FSDP degree (-1: the ranks the other degrees leave)",
        minimum=-1,
    ),
    Option("tp", "parallel", int, 1, "tensor-parallel degree", minimum=1),
    Option("pp", "parallel", int, 1, "pipeline-parallel degree", minimum=1),
    Option("cp", "parallel", int, 1, "context-parallel degree", minimum=1),
    Option(
        "ep", "parallel", int, 1, "expert-parallel degree, borrowed from dp_shard x cp", minimum=1
    ),
    Option("pp_schedule", "parallel", str, "1F1B", "pipeline schedule", choices=PP_SCHEDULES),
    Option(
        "pp_microbatches",
        "parallel",
        int,
        0,
        "pipeline micro-batches (0: one per local sequence)",
        minimum=0,
    ),
    Option(
        "pp_stages_per_rank",
        "parallel",
        int,
        0,
        "pipeline stages per rank (0: the schedule's own)",
        minimum=0,
    ),
    Option(
        "pp_first_stage_less_layers",
        "parallel",
        int,
        0,
        "blocks fewer on the first pipeline stage than on the others, which the embedding "
        "weighs (Llama 3 405B: 126 layers on 16 stages with 1 here and 1 on the last)",
        minimum=0,
    ),
    Option(
        "pp_last_stage_less_layers",
        "parallel",
        int,
        0,
        "blocks fewer on the last pipeline stage than on the others, which the output head weighs",
        minimum=0,
    ),
    Option(
        "pp_layers_per_stage",
        "parallel",
        tuple,
        (),
        "the blocks of each pipeline stage, in stage order, summing to n_layers (instead of an "
        "even split and the two options above)",
    ),
    Option("mixed_precision", "parallel", bool, False, "bf16 compute, fp32 gradient reductions"),
    Option(
        "activation_checkpointing",
        "parallel",
        bool,
        False,
        "recompute each block's forward in backward",
    ),
    Option(
        "compile",
        "parallel",
        bool,
        False,
        "torch.compile each transformer block (FP8's casts fuse only then)",
    ),
    # [fp8]
    Option(
        "fp8",
        "fp8",
        str,
        "none",
        "FP8 recipe of the linears",
        key="recipe",
        choices=RECIPE_CHOICES,
        alters_results=True,
    ),
    Option(
        "fp8_keep_high_precision",
        "fp8",
        tuple,
        ("output", "router"),
        "linears kept out of FP8, by dotted name parts",
        key="keep_high_precision",
        alters_results=True,
    ),
    Option(
        "fp8_options",
        "fp8",
        tuple,
        (),
        "changes to the recipe, KEY=VALUE: forward_format, backward_format (e4m3|e5m2), "
        "amax_history_len, amax_compute (max|most_recent), margin, power_of_two_scales",
        key="options",
        repeated=True,
        flag_name="--fp8-option",
        alters_results=True,
    ),
    Option(
        "fp8_strict",
        "fp8",
        bool,
        False,
        "refuse a linear whose shape does not fit the recipe (default: keep it high precision)",
        key="strict",
    ),
    Option(
        "fp8_all_gather",
        "fp8",
        bool,
        False,
        "FSDP all-gathers the FP8 linears' weights in FP8 (not with mxfp8)",
        key="all_gather",
    ),
    Option(
        "fp8_count_every",
        "fp8",
        int,
        10,
        "count saturated and underflowed FP8 values every N steps",
        key="count_every",
        minimum=1,
    ),
    # [optimizer]: AdamW
    Option(
        "lr",
        "optimizer",
        float,
        3e-3,
        "peak learning rate",
        minimum=0,
        exclusive=True,
        alters_results=True,
    ),
    Option("beta1", "optimizer", float, 0.9, "AdamW beta1", minimum=0, alters_results=True),
    Option("beta2", "optimizer", float, 0.95, "AdamW beta2", minimum=0, alters_results=True),
    Option(
        "eps",
        "optimizer",
        float,
        1e-8,
        "AdamW epsilon",
        minimum=0,
        exclusive=True,
        alters_results=True,
    ),
    Option(
        "weight_decay",
        "optimizer",
        float,
        0.1,
        "AdamW decoupled weight decay",
        minimum=0,
        alters_results=True,
    ),
    Option(
        "no_decay",
        "optimizer",
        tuple,
        ("norm", "bias", "embeddings"),
        "parameters without weight decay: those whose name contains one of these",
        alters_results=True,
    ),
    Option(
        "max_grad_norm",
        "optimizer",
        float,
        1.0,
        "clip gradients to this global norm (0: no clipping)",
        minimum=0,
        alters_results=True,
    ),
    # [schedule]
    Option(
        "steps",
        "schedule",
        int,
        300,
        "optimizer steps of the whole run (a resume may extend it)",
        minimum=1,
        launcher=True,
    ),
    Option(
        "warmup_steps",
        "schedule",
        int,
        20,
        "linear warm-up from lr/warmup to lr",
        minimum=0,
        alters_results=True,
    ),
    Option(
        "decay",
        "schedule",
        str,
        "cosine",
        "after warm-up: constant, linear, cosine, or wsd (stable, then a linear decay over the "
        "last decay_fraction)",
        choices=DECAYS,
        alters_results=True,
    ),
    Option(
        "min_lr_ratio",
        "schedule",
        float,
        0.1,
        "the decay ends at lr * min_lr_ratio",
        minimum=0,
        alters_results=True,
    ),
    Option(
        "decay_steps",
        "schedule",
        int,
        0,
        "the step the decay ends at (0: --steps)",
        minimum=0,
        alters_results=True,
    ),
    Option(
        "decay_fraction",
        "schedule",
        float,
        0.2,
        "wsd: the final fraction of the steps that decays",
        minimum=0,
        exclusive=True,
        alters_results=True,
    ),
    # [data]
    Option("seq_len", "data", int, 128, "tokens per sequence", minimum=1, alters_results=True),
    Option(
        "global_batch",
        "data",
        int,
        16,
        "sequences per optimizer step, over every data-parallel rank",
        minimum=1,
        alters_results=True,
    ),
    Option(
        "grad_accum_steps",
        "data",
        int,
        1,
        "micro-batches per optimizer step on each rank (global batch = micro-batch x this x dp)",
        minimum=1,
        alters_results=True,
    ),
    Option(
        "data",
        "data",
        str,
        "",
        "a prepared directory (scaletrain data prepare) or a blend DIR_A:0.7,DIR_B:0.3; the "
        "vocabulary comes from its tokenizer (empty: the built-in corpus)",
        alters_results=True,
    ),
    Option(
        "document_masking",
        "data",
        bool,
        False,
        "attention stays within each document of a packed window and positions restart at each "
        "document (needs --data; not with pp or cp > 1)",
        alters_results=True,
    ),
    Option(
        "eval_data",
        "data",
        str,
        "",
        "a prepared directory of held-out data, for the validation loss (empty: none)",
    ),
    Option(
        "eval_every",
        "data",
        int,
        0,
        "compute the validation loss on --eval-data every N steps and at the last (0: never)",
        minimum=0,
    ),
    Option(
        "eval_batches",
        "data",
        int,
        4,
        "global batches of --eval-data in each validation loss (the same ones every time)",
        minimum=1,
    ),
    Option(
        "corpus_bytes",
        "data",
        int,
        4 << 20,
        "bytes of the built-in corpus (the stdlib's sources)",
        minimum=1,
        alters_results=True,
    ),
    # [checkpoint]
    Option(
        "ckptd",
        "checkpoint",
        str,
        "",
        "HOST:PORT of ckptd; without it no checkpoint is saved",
        launcher=True,
    ),
    Option(
        "ckpt_every",
        "checkpoint",
        int,
        100,
        "steps between checkpoints (0: only the last)",
        minimum=0,
        launcher=True,
    ),
    Option(
        "mem_ckpt_every",
        "checkpoint",
        int,
        0,
        "keep every K-th step in this node's and one peer's memory only, between the durable "
        "checkpoints of --ckpt-every; a lost node or rank then costs at most K steps (0: off; "
        "needs --ckptd)",
        minimum=0,
    ),
    Option(
        "ckpt_policy",
        "checkpoint",
        str,
        "wait",
        "a save requested while the previous one streams: wait for it, or skip this one",
        choices=("wait", "skip"),
    ),
    Option(
        "replicas",
        "checkpoint",
        int,
        0,
        "copies of each node's part on distinct nodes (0: ckptd's default)",
        minimum=0,
    ),
    Option(
        "resume", "checkpoint", bool, False, "continue from the latest checkpoint", launcher=True
    ),
    Option(
        "resume_wait_s",
        "checkpoint",
        float,
        120.0,
        "how long a run with committed checkpoints waits for one to be restorable (a node "
        "holding a part down or behind) before it stops; it never starts over",
        minimum=0,
    ),
    Option(
        "init_from_hf",
        "checkpoint",
        str,
        "",
        "a Hugging Face LlamaForCausalLM directory (config.json, safetensors) whose weights a new "
        "run starts from instead of the seed's, resharded to its layout (empty: none)",
        # Not compared on resume: a resumed run's weights come from its checkpoint.
    ),
    Option(
        "allow_config_change",
        "checkpoint",
        bool,
        False,
        "resume even though options that alter results changed (the run records the changes)",
    ),
    # [health]
    Option(
        "health_policy",
        "health",
        str,
        "rollback",
        "what to do with a suspicious step",
        choices=POLICIES,
    ),
    Option(
        "check_reductions",
        "health",
        bool,
        False,
        "check that each FSDP reduce-scatter's result sums to its inputs (catches a flip in the "
        "reduced gradients that no replica sees; adds 1-8 percent to a small CPU step)",
    ),
    Option(
        "quarantine",
        "health",
        str,
        "cordon",
        "what to do with a rank the silent-data-corruption checks named --quarantine-after times: "
        "cordon its machine (a waiting spare takes its place), alert only, or off",
        choices=QUARANTINE_POLICIES,
    ),
    Option(
        "quarantine_after",
        "health",
        int,
        2,
        "times the silent-data-corruption checks name a rank before it is quarantined",
        minimum=1,
    ),
    Option(
        "collective_timeout_s",
        "health",
        float,
        600.0,
        "timeout of every collective",
        minimum=0,
        exclusive=True,
    ),
    Option(
        "in_job_restarts",
        "health",
        int,
        10,
        "times a failed rank is restarted inside the job (every rank forked again by the process "
        "that keeps it, no new interpreter) before torchrun's agent restarts the job cold (0: off)",
        minimum=0,
    ),
    Option(
        "watchdog_min_s",
        "health",
        float,
        120.0,
        "a phase without progress this long fails the rank, at the least",
        minimum=0,
        exclusive=True,
    ),
    Option(
        "watchdog_factor",
        "health",
        float,
        10.0,
        "... or this many times the slowest recent step, if longer",
        minimum=0,
        exclusive=True,
    ),
    Option(
        "heartbeat_s",
        "health",
        float,
        10.0,
        "seconds between heartbeats to telemetry",
        minimum=0,
        exclusive=True,
    ),
    Option(
        "inject_sdc", "health", tuple, (), "flip a bit of a gradient or parameter", repeated=True
    ),
    Option(
        "inject_straggler", "health", tuple, (), "make a rank slower in every step", repeated=True
    ),
    Option("inject_loss_spike", "health", tuple, (), "train step K on a bad batch", repeated=True),
    Option(
        "inject_bad_device",
        "health",
        tuple,
        (),
        "make a rank's device fail the health check before start",
        repeated=True,
    ),
    # [telemetry]
    Option(
        "telemetry",
        "telemetry",
        str,
        "",
        "HOST:PORT of the telemetry service",
        key="address",
        launcher=True,
    ),
    Option(
        "peak_flops",
        "telemetry",
        float,
        0.0,
        "dense peak FLOP/s of one device, for MFU (0: the datasheet, or calibration on CPU)",
        minimum=0,
    ),
)
BY_DEST = {o.dest: o for o in OPTIONS}
_BY_KEY = {(o.section, o.toml_key): o for o in OPTIONS}


def add_arguments(
    parser: argparse.ArgumentParser, *, launcher: bool = False, exclude: tuple[str, ...] = ()
) -> None:
    """Every option as a flag of `parser`, grouped by section. Unset flags stay absent from the
    namespace (their defaults come in through `resolve`, after the config file). `launcher`:
    leave out the options a launcher sets itself; `exclude`: these too."""
    parser.add_argument("--config", type=Path, metavar="JOB.toml", help="a job config file")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for o in OPTIONS:
        if (launcher and o.launcher) or o.dest in exclude:
            continue
        group = groups.get(o.section)
        if group is None:
            title = f"[{o.section}]" if o.section else "job"
            group = groups[o.section] = parser.add_argument_group(title)
        shown = ",".join(o.default) if isinstance(o.default, tuple) else o.default
        common = {
            "dest": o.dest,
            "default": argparse.SUPPRESS,
            "help": f"{o.help} (default {shown!s})" if shown != "" else f"{o.help} (default: none)",
        }
        if o.kind is bool:
            group.add_argument(o.flag, action=argparse.BooleanOptionalAction, **common)
        elif o.repeated:
            # Also under the dest's own flag, which the Helm chart derives from the name.
            flags = dict.fromkeys((o.flag, "--" + o.dest.replace("_", "-")))
            metavar = FAULT_METAVARS.get(o.dest, "KEY=VALUE")
            group.add_argument(*flags, action="append", metavar=metavar, **common)
        elif o.kind is tuple:
            # Given again, a list flag adds to the list ("" adds nothing: the empty list).
            group.add_argument(o.flag, type=_names, action="extend", metavar="NAME,...", **common)
        else:
            old = {"action": Renamed} if o.old_flag else {}
            flags = (o.flag, o.old_flag) if o.old_flag else (o.flag,)
            group.add_argument(*flags, type=o.kind, choices=o.choices or None, **common, **old)


class Renamed(argparse.Action):
    """An option whose former name (its second option string, or the whole option where
    `renamed` gives its new form) still works for one release, with a one-line notice on
    stderr."""

    def __init__(self, option_strings: list[str], dest: str, renamed: str = "", **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.renamed = renamed

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        new = self.renamed or self.option_strings[0]
        if option_string != new:
            print(
                f"scaletrain: {option_string} is deprecated and goes in the next release: use "
                f"{new}",
                file=sys.stderr,
            )
        setattr(namespace, self.dest, values)


def _names(text: str) -> tuple[str, ...]:
    return tuple(n for n in text.split(",") if n)


def given(args: argparse.Namespace) -> dict[str, Value]:
    """The options set on a command line parsed with `add_arguments`, checked."""
    return {d: BY_DEST[d].check(getattr(args, d)) for d in BY_DEST if hasattr(args, d)}


def read_config(path: Path) -> dict[str, Value]:
    """The options a job config file sets, by dest; ValueError in one line naming the file and
    the key (or the line and column of a syntax error)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror})") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    return from_document(doc, str(path))


def from_document(doc: Mapping[str, object], name: str) -> dict[str, Value]:
    """The options of a parsed job config (see `read_config`)."""
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        found = "no format_version" if version is None else f"format_version {version!r}"
        raise ValueError(
            f"{name}: {found}; this trainer reads format_version = {FORMAT_VERSION} "
            "(`scaletrain run --print-config` writes one)"
        )
    values: dict[str, Value] = {}
    for key, value in doc.items():
        if key == "format_version":
            continue
        if isinstance(value, dict) and key in SECTIONS:
            entries = [(key, k, v) for k, v in value.items()]
        else:
            entries = [("", key, value)]
        for section, k, v in entries:
            option = _BY_KEY.get((section, k))
            if option is None:
                dotted = f"{section}.{k}" if section else k
                known = sorted(o.toml_key for o in OPTIONS if o.section == section)
                raise ValueError(
                    f"{name}: unknown key {dotted!r}; "
                    + (
                        f"[{section}] takes: {', '.join(known)}"
                        if section
                        else f"sections: {', '.join(SECTIONS[1:])}"
                    )
                )
            try:
                values[option.dest] = option.check(v)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
    return values


def resolve(
    command_line: Mapping[str, Value],
    config: Path | None = None,
    defaults: Mapping[str, Value] | None = None,
    stored: Mapping[str, object] | None = None,
) -> dict[str, Value]:
    """Every option's value: default (or a launcher's own, `defaults`), then the preset's (or,
    resuming, the run's own stored job, `stored`: its resolved values, its shape included), then
    the file's, then the command line's. ValueError in one line for a bad value, key, file or
    preset."""
    from_file = read_config(config) if config is not None else {}
    explicit = {**from_file, **{d: BY_DEST[d].check(v) for d, v in command_line.items()}}
    values = {o.dest: o.default for o in OPTIONS} | dict(defaults or {})
    if stored:
        values.update({d: BY_DEST[d].check(v) for d, v in stored.items()})
    else:
        shape = preset(str(explicit.get("preset", BY_DEST["preset"].default)))
        values.update({d: BY_DEST[d].check(v) for d, v in shape.items()})
    if explicit.get("data"):
        values["vocab_size"] = _data_vocab(str(explicit["data"]), explicit.get("vocab_size"))
    values.update(explicit)
    return values


def _data_vocab(data: str, vocab_size: Value | None) -> int:
    """The model's vocabulary for `--data`: its tokenizer's, or an explicit larger one (padded,
    as Megatron pads it); ValueError for one that would not fit the tokens."""
    from scaletrain.errors import UserError
    from trainer.data.shards import data_tokenizer

    try:
        needed = int(data_tokenizer(data)["vocab_size"])
    except UserError as exc:
        raise ValueError(str(exc)) from None
    if vocab_size is not None and int(vocab_size) < needed:
        raise ValueError(
            f"--vocab-size {vocab_size} is smaller than the vocabulary {needed:,} of the "
            f"tokenizer of --data {data}; leave --vocab-size out to take the tokenizer's"
        )
    return needed if vocab_size is None else int(vocab_size)


def to_toml(values: Mapping[str, Value]) -> str:
    """`values` as a job config file, every option in its section (what --print-config prints,
    and what a checkpoint and telemetry keep); reading it back gives the same values."""
    lines = [f"format_version = {FORMAT_VERSION}"]
    for section in SECTIONS:
        if section:
            lines += ["", f"[{section}]"]
        lines += [
            f"{o.toml_key} = {_toml_value(values[o.dest])}"
            for o in OPTIONS
            if o.section == section and o.dest in values
        ]
    return "\n".join(lines) + "\n"


def _toml_value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def passed_on(values: Mapping[str, Value]) -> dict[str, Value]:
    """What a launcher hands the trainer of a resolved job: the values that differ from the
    defaults, except those it sets itself."""
    return {d: v for d, v in values.items() if not BY_DEST[d].launcher and v != BY_DEST[d].default}


def to_argv(values: Mapping[str, Value]) -> list[str]:
    """A command line that sets `values` (the inverse of parsing with `add_arguments`)."""
    argv: list[str] = []
    for dest, value in values.items():
        o = BY_DEST[dest]
        if o.kind is bool:
            argv.append(o.flag if value else "--no-" + o.flag[2:])
        elif o.repeated:
            argv += [x for item in value for x in (o.flag, item)]  # type: ignore[union-attr]
        elif o.kind is tuple:
            argv += [o.flag, ",".join(value)]  # type: ignore[arg-type]
        else:
            argv += [o.flag, str(value)]
    return argv


def differences(saved: Mapping[str, Value], now: Mapping[str, Value]) -> list[str]:
    """The options that alter results whose value in `now` differs from `saved` (a checkpoint's
    resolved config), as `section.key: old -> new`."""
    changed = []
    for o in OPTIONS:
        if o.alters_results and o.dest in saved and saved[o.dest] != now.get(o.dest):
            dotted = f"{o.section}.{o.toml_key}" if o.section else o.toml_key
            changed.append(f"{dotted}: {saved[o.dest]!r} -> {now.get(o.dest)!r}")
    return changed


def from_toml(text: str) -> dict[str, Value]:
    """The values of a resolved config written by `to_toml` (a checkpoint's)."""
    return from_document(tomllib.loads(text), "the saved config")


def helm_schema() -> dict[str, object]:
    """The JSON schema of the chart's `trainer.options`: every option a launcher does not set,
    under its dest, typed and bounded as here (helm/scaletrain/values.schema.json holds it)."""
    properties: dict[str, object] = {}
    for o in OPTIONS:
        if o.launcher:
            continue
        schema: dict[str, object] = {
            int: {"type": "integer"},
            float: {"type": "number"},
            str: {"type": "string"},
            bool: {"type": "boolean"},
            tuple: {"type": "array", "items": {"type": "string"}},
        }[o.kind].copy()
        if o.choices:
            schema["enum"] = list(o.choices)
        if o.minimum is not None:
            schema["exclusiveMinimum" if o.exclusive else "minimum"] = o.minimum
        schema["description"] = o.help
        properties[o.dest] = schema
    return {"type": "object", "additionalProperties": False, "properties": properties}


SCHEMA_FILE = Path(__file__).resolve().parents[1] / "helm" / "scaletrain" / "values.schema.json"


def write_helm_schema(path: Path = SCHEMA_FILE) -> None:
    """Put `helm_schema()` into the chart's values schema as `trainer.options`, after a change
    to OPTIONS: `python -m trainer.options`."""
    schema = json.loads(path.read_text())
    schema["properties"]["trainer"]["properties"]["options"] = helm_schema()
    path.write_text(json.dumps(schema, indent=2) + "\n")


if __name__ == "__main__":
    write_helm_schema()
