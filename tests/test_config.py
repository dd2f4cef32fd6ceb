"""The typed config: precedence, every error path (naming its key), the resolved-config round trip, train_configs."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from hola_titan.config import (
    SECTIONS,
    ConfigError,
    JobConfig,
    Resume,
    check_fields,
    field_docs,
    flat_items,
    load_toml,
    parse_config,
    resolve_degrees,
    setting,
    to_dict,
    to_toml,
    validate,
    write_resolved,
)
from hola_titan.preflight import main as preflight_main

TRAIN_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "train_configs").glob("*.toml"))


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def _raises(key: str, argv: list[str], *, match: str | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(argv)
    assert info.value.key == key and str(info.value).startswith(f"{key}: "), str(info.value)
    assert "\n" not in str(info.value)
    if match is not None:
        assert match in str(info.value), str(info.value)
    return info.value


def _invalid(key: str, argv: list[str], *, world_size: int = 1, match: str | None = None) -> None:
    config = parse_config(argv)
    with pytest.raises(ConfigError) as info:
        validate(config, world_size=world_size)
    assert info.value.key == key and str(info.value).startswith(f"{key}: "), str(info.value)
    assert "\n" not in str(info.value)
    if match is not None:
        assert match in str(info.value), str(info.value)


# ---- schema ------------------------------------------------------------------------------------------------------


def test_every_field_has_a_docstring():
    keys = {f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    docs = field_docs()
    assert keys <= docs.keys(), sorted(keys - docs.keys())
    assert all(docs[k] for k in keys)


def test_optional_fields_default_to_none():
    # None is written by leaving the key out, which only round-trips when the default is None.
    for section, table in to_dict(JobConfig()).items():
        for name, f in zip(table, dataclasses.fields(SECTIONS[section])):
            if "None" in str(f.type):
                assert table[name] is None, f"{section}.{name}"


def _fields():
    """(key, type, metadata) of every config field."""
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield f"{section}.{f.name}", hints[f.name], f.metadata


def test_every_field_has_a_resume_class():
    # A field added without setting(..., resume=...) fails here: a resume would not know whether to compare it.
    missing = [key for key, _, metadata in _fields() if metadata.get("resume") not in typing.get_args(Resume)]
    assert not missing, missing
    with pytest.raises(TypeError, match="resume class 'fixd'"):
        setting(1, resume="fixd")


_BOUNDED = [(key, hint, metadata) for key, hint, metadata in _fields() if {"ge", "gt", "le", "lt"} & set(metadata)]


@pytest.mark.parametrize("key, hint, metadata", _BOUNDED, ids=[key for key, _, _ in _BOUNDED])
def test_every_bound_is_enforced_naming_the_key(key, hint, metadata):
    width = len(typing.get_args(hint)) if typing.get_origin(hint) is tuple else 1
    for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if name in metadata:
            bound = metadata[name]
            outside = {"ge": bound - 1, "gt": bound, "le": bound + 1, "lt": bound}[name]
            _raises(key, [f"--{key}", ",".join([str(outside)] * width)], match=f"must be {sign} {bound}")


def _changed(key: str, hint) -> JobConfig | None:
    """The defaults with ``key`` set to another valid value (None: there is none)."""
    section, name = key.split(".")
    literal = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()
    for value in [False, True, 3, 0.5, (0.5, 0.25), ["other"], "3", "other", None, *literal]:
        config = JobConfig()
        setattr(getattr(config, section), name, value)
        try:
            check_fields(config)
        except ConfigError:
            continue
        if flat_items(config)[key] != flat_items(JobConfig())[key]:
            return config
    return None


def test_the_resume_class_of_a_field_decides_what_a_resume_does_with_it():
    from hola_titan.checkpoint import CheckpointMismatchError
    from hola_titan.resume import plan_resume

    degrees = resolve_degrees(JobConfig().parallelism, JobConfig().training, world_size=1)
    saved = {"config": to_toml(JobConfig()), "global_batch_size": degrees.global_batch_size, "tokenizer": "t"}
    unchangeable = []
    for key, hint, metadata in _fields():
        config = _changed(key, hint)
        if config is None:
            unchangeable.append(key)
            continue
        resume = dict(path="step-4", config=config, degrees=degrees, tokenizer_fingerprint="t")
        if metadata["resume"] == "fixed":
            with pytest.raises(CheckpointMismatchError, match=rf"^{key}: .* a resumed run cannot change it"):
                plan_resume(saved, **resume)
        else:
            expected = set() if metadata["resume"] == "launch" else {key}
            assert set(plan_resume(saved, **resume).changes) == expected, key
    assert unchangeable == ["optimizer.name"]


# ---- precedence --------------------------------------------------------------------------------------------------


def test_defaults():
    config = parse_config([])
    assert config == JobConfig()
    assert config.model.flavour == "hola" and config.model.size == "debug"
    assert config.model.tokenizer_path == "bundled" and config.data.dataset == "bundled"
    assert config.optimizer.betas == (0.9, 0.95) and config.float8.filter_fqns == ["output"]
    assert config.dry_run is False


def test_precedence_defaults_toml_cli(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 7\nseq_len = 512\n[optimizer]\nlr = 1e-3\n")
    config = parse_config(["--job.config_file", path, "--training.steps", "9"])
    assert config.job.config_file == path
    assert config.training.steps == 9  # CLI over TOML
    assert config.training.seq_len == 512 and config.optimizer.lr == 1e-3  # TOML over defaults
    assert config.training.local_batch_size == JobConfig().training.local_batch_size  # defaults
    # The config file is read first wherever it appears on the line.
    assert parse_config(["--training.steps=9", f"--job.config_file={path}"]).training.steps == 9


def test_cli_forms():
    config = parse_config([
        "--training.seq_len=64", "--compile.enable", "--compile.fullgraph", "false", "--optimizer.betas", "0.8,0.9",
        "--float8.filter_fqns", "output,lm_head", "--model.window", "16", "--training.global_batch_size", "-1",
        "--data.streaming", "no", "--dry-run", "--optimizer.fused=true", "--training.deterministic",
    ])
    assert config.training.seq_len == 64
    assert config.compile.enable is True and config.compile.fullgraph is False
    assert config.optimizer.betas == (0.8, 0.9) and config.float8.filter_fqns == ["output", "lm_head"]
    assert config.model.window == 16 and config.training.global_batch_size == -1
    assert config.data.streaming is False and config.optimizer.fused is True and config.training.deterministic
    assert config.dry_run is True
    assert parse_config(["--model.window", "16", "--model.window", "none"]).model.window is None
    assert parse_config(["--float8.filter_fqns", ""]).float8.filter_fqns == []


def test_help(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    assert "--training.seq_len" in capsys.readouterr().out


# ---- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, key, match", [
    (["--foo.bar", "1"], "foo.bar", "unknown config section"),
    (["--training.foo", "1"], "training.foo", "unknown key"),
    (["--training.seq_len", "abc"], "training.seq_len", "expected int, got 'abc'"),
    (["--training.seq_len", "2.5"], "training.seq_len", "expected int"),
    (["--optimizer.lr", "fast"], "optimizer.lr", "expected float"),
    (["--optimizer.lr", "nan"], "optimizer.lr", "finite"),
    (["--compile.enable", "maybe"], "compile.enable", "expected bool"),
    (["--optimizer.betas", "0.9"], "optimizer.betas", "2 values"),
    (["--model.flavour", "mamba"], "model.flavour", "expected one of"),
    (["--training.device", "tpu"], "training.device", "expected one of"),
    (["--model.cache_kernels", "gluon"], "model.cache_kernels", "expected one of auto, triton; got 'gluon'"),
    (["--training.steps", "-5"], "training.steps", ">= 1"),
    (["--training.seq_len", "0"], "training.seq_len", ">= 1"),
    (["--training.global_batch_size", "0"], "training.global_batch_size", ">= 1 or -1"),
    (["--parallelism.data_parallel_shard_degree", "-2"], "parallelism.data_parallel_shard_degree", ">= 1 or -1"),
    (["--optimizer.lr", "0"], "optimizer.lr", "> 0"),
    (["--optimizer.betas", "0.9,1.0"], "optimizer.betas", "[0, 1)"),
    (["--lr_scheduler.min_lr_factor", "1.5"], "lr_scheduler.min_lr_factor", "<= 1"),
    (["--activation_checkpoint.selective_ac_option", "0"], "activation_checkpoint.selective_ac_option", "'op'"),
    (["--training.steps"], "training.steps", "missing value"),
    (["--job.config_file", "/nonexistent/job.toml"], "job.config_file", "no such file"),
    (["stray"], "stray", "unknown argument"),
    (["--dryrun"], "--dryrun", "unknown argument"),
])
def test_cli_errors(argv, key, match):
    _raises(key, argv, match=match)


@pytest.mark.parametrize("text, key, match", [
    ("[foo]\nbar = 1\n", "foo", "unknown config section"),
    ("steps = 1\n", "steps", "unknown config section"),
    ("[training]\nfoo = 1\n", "training.foo", "unknown key"),
    ("[training]\nseq_len = 'abc'\n", "training.seq_len", "expected int, got 'abc'"),
    ("[training]\nsteps = 1e4\n", "training.steps", "expected int"),
    ("[compile]\nenable = 1\n", "compile.enable", "expected bool"),
    ("[model]\nwindow = true\n", "model.window", "expected int"),
    ("[model]\nsize = '13B'\n", "model.size", "expected one of"),
    ("[optimizer]\nbetas = [0.9, 'x']\n", "optimizer.betas", "expected float"),
    ("[float8]\nfilter_fqns = 'output'\n", "float8.filter_fqns", "expected list of str"),
    ("[training]\nsteps = -3\n", "training.steps", ">= 1"),
    ("[training\nsteps = 3\n", "job.config_file", "cannot parse TOML"),
    ("[training]\nsteps = \n", "job.config_file", "cannot parse TOML"),
])
def test_toml_errors(tmp_path, text, key, match):
    path = _toml(tmp_path, text)
    error = _raises(key, ["--job.config_file", path], match=match)
    # Type errors name the file; bounds are checked after the command line is merged, so they cannot.
    assert key == "job.config_file" or match.startswith(">=") or path in str(error)


def test_toml_folder_is_an_error(tmp_path):
    _raises("job.config_file", ["--job.config_file", str(tmp_path)], match="folder")


# ---- cross-field checks ------------------------------------------------------------------------------------------


def test_resolve_degrees_fills_shard_and_accumulates():
    config = parse_config(["--training.local_batch_size", "4", "--training.global_batch_size", "64",
                           "--parallelism.tensor_parallel_degree", "2"])
    degrees = resolve_degrees(config.parallelism, config.training, world_size=8)
    assert (degrees.dp_shard, degrees.dp, degrees.tp, degrees.grad_accum_steps) == (4, 4, 2, 4)
    degrees = resolve_degrees(config.parallelism, parse_config([]).training, world_size=8)
    assert degrees.global_batch_size == 8 * 4 and degrees.grad_accum_steps == 1


@pytest.mark.parametrize("argv, world_size, key, match", [
    (["--parallelism.data_parallel_shard_degree", "2"], 4, "parallelism.data_parallel_shard_degree", "world size is 4"),
    (["--parallelism.tensor_parallel_degree", "3"], 4, "parallelism.tensor_parallel_degree", "does not divide the 4"),
    (["--parallelism.tensor_parallel_degree", "4"], 4, "parallelism.tensor_parallel_degree", "2 heads"),
    (["--training.seq_len", "100"], 1, "training.seq_len", "block 32"),
    (["--training.seq_len", "96", "--parallelism.context_parallel_degree", "5"], 5, "training.seq_len",
     "context_parallel_degree 5"),
    (["--training.seq_len", "64", "--parallelism.context_parallel_degree", "32"], 32, "training.seq_len",
     "fewer than conv_size - 1"),
    (["--model.block", "48", "--training.seq_len", "256"], 1, "training.seq_len", "block 48"),
    (["--model.flavour", "transformer", "--parallelism.context_parallel_degree", "2"], 2, "data.varlen", "false"),
    (["--training.global_batch_size", "12"], 2, "training.global_batch_size", "multiple"),
    (["--float8.enable"], 1, "float8.enable", "cuda"),
    (["--parallelism.context_parallel_degree", "2", "--compile.enable"], 2, "compile.fullgraph", "must be false"),
    (["--model.save_cache_output", "--model.flavour", "gdn"], 1, "model.save_cache_output", "gdn has no HOLA cache"),
    (["--model.save_cache_output", "--model.flavour", "transformer"], 1, "model.save_cache_output",
     "transformer has no HOLA cache"),
    (["--model.save_cache_output", "--model.overlap_backward"], 1, "model.save_cache_output", "overlap_backward"),
    (["--model.cache_kernels", "triton", "--model.attention_backend", "sdpa"], 1, "model.cache_kernels", "sdpa"),
    (["--model.cache_kernels", "triton", "--model.flavour", "gdn"], 1, "model.cache_kernels", "gdn has no HOLA"),
    (["--model.save_cache_output", "--model.attention_backend", "sdpa"], 1, "model.save_cache_output",
     "model.attention_backend is sdpa"),
])
def test_validate_errors(argv, world_size, key, match):
    _invalid(key, ["--training.seq_len", "256", *argv], world_size=world_size, match=match)


@pytest.mark.parametrize("argv, setting, resolved", [
    ([], None, True),
    (["--model.overlap_backward"], True, True),  # a bare flag sets a ``bool | None`` key too
    (["--model.overlap_backward", "false"], False, False),
    (["--model.overlap_backward", "none"], None, True),
    (["--model.save_cache_output"], None, False),  # left unset, the overlapped backward gives way to the kept output
    (["--model.save_cache_output", "--model.overlap_backward", "false"], False, False),
])
def test_overlap_backward_unset_is_on_unless_the_cache_output_is_kept(argv, setting, resolved):
    from hola_titan.config import overlap_backward

    config = parse_config(["--training.seq_len", "256", *argv])
    validate(config, world_size=1)
    assert config.model.overlap_backward is setting
    assert overlap_backward(config.model) is resolved


def test_a_bare_flag_needs_a_boolean_key():
    with pytest.raises(ConfigError, match="model.window: missing value"):
        parse_config(["--model.window"])


def test_n_layers_overrides_the_depth_of_a_size():
    from hola_titan.builder import build_model_args

    config = parse_config(["--model.size", "340M", "--model.n_layers", "4"])
    validate(config, world_size=1)
    args = build_model_args(config, vocab_size=100)
    assert (args.n_layers, args.dim, args.n_heads, args.head_dim) == (4, 1024, 4, 256)
    assert build_model_args(parse_config(["--model.size", "340M"]), vocab_size=100).n_layers == 24
    with pytest.raises(ConfigError, match=r"^model\.n_layers: must be >= 1, got 0"):
        parse_config(["--model.n_layers", "0"])


@pytest.mark.parametrize("argv, world_size, key, match", [
    # A block longer than a row was refused as a seq_len mistake ("not a multiple of block 4096").
    (["--model.block", "4096", "--training.seq_len", "2048"], 1, "model.block", "at most 2048"),
    (["--training.loss_chunk_size", "16385"], 1, "training.loss_chunk_size", "at most 16384"),  # 8 rows x 2048
    (["--training.loss_chunk_size", "4097", "--parallelism.context_parallel_degree", "4"], 4,
     "training.loss_chunk_size", "/ context_parallel_degree 4), all of which one chunk already holds; at most 4096"),
    (["--training.loss_chunk_size", "64", "--parallelism.tensor_parallel_degree", "2"], 2, "training.loss_chunk_size",
     "no effect with tensor_parallel_degree 2"),
])
def test_size_keys_are_bounded_by_the_run_s_other_keys(argv, world_size, key, match):
    _invalid(key, argv, world_size=world_size, match=match)
    _raises("data.holdout_every", ["--data.holdout_every", "1"], match="must be >= 2 or 0")  # 1 holds out everything


def test_a_rank_that_cannot_hold_the_training_state_or_the_block_inputs_is_refused_naming_the_key():
    """check_memory's floors: 16 bytes a matmul weight over the FSDP and tensor shards, and every block's input of a
    micro-batch; the recipes at their 8-GPU layout fit an 80 GiB GPU."""
    from hola_titan.builder import build_model_args
    from hola_titan.config import check_memory

    gib = 2 ** 30

    def check(argv: list[str], *, world_size: int = 1, device_gib: float = 80, host_gib: float = 1024) -> None:
        config = parse_config(argv)
        validate(config, world_size=world_size)
        degrees = resolve_degrees(config.parallelism, config.training, world_size=world_size)
        check_memory(config, build_model_args(config, config.model.vocab_size or 32000), degrees,
                     device_bytes=int(device_gib * gib), device_what="an 80 GiB GPU",
                     host_bytes=int(host_gib * gib), host_what="the host")

    seven_b = ["--model.size", "7B", "--training.local_batch_size", "4", "--training.mixed_precision_param",
               "bfloat16"]
    with pytest.raises(ConfigError, match=r"^model.size: hola 7B with 32 blocks has at least 6,611,271,680 "
                                          r"parameters, .* need at least 98.5 GiB per rank, more than the 80.0 GiB of "
                                          r"an 80 GiB GPU; shard it over more ranks"):
        check(seven_b)
    check([*seven_b, "--parallelism.fsdp_cpu_offload"])  # the state in the host's memory
    check(seven_b, world_size=8)  # 8 FSDP shards
    with pytest.raises(ConfigError, match=r"^model.n_layers: hola debug with 100000000 blocks"):
        check(["--model.n_layers", "100000000"])
    with pytest.raises(ConfigError, match=r"^training.local_batch_size: 1000000 rows x 2048 tokens .* keep at least "
                                          r"1,953.1 GiB of block inputs per rank for the backward \(2 blocks x 128 "
                                          r"values x 4 bytes"):
        check(["--training.local_batch_size", "1000000", "--training.mixed_precision_param", "float32"])
    with pytest.raises(ConfigError, match=r"^training.seq_len: 1 rows x 1073741824 tokens"):
        check(["--training.local_batch_size", "1", "--training.seq_len", str(2 ** 30)])
    for path in TRAIN_CONFIGS:
        check(["--job.config_file", str(path)], world_size=8)


def test_validate_accepts_cross_field_layouts():
    validate(parse_config(["--model.flavour", "transformer", "--parallelism.context_parallel_degree", "2",
                           "--data.varlen", "false", "--training.seq_len", "256"]), world_size=2)
    validate(parse_config(["--float8.enable", "--training.device", "cuda", "--training.seq_len", "256"]),
             world_size=1)
    validate(parse_config(["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.context_parallel_degree",
                           "2", "--training.seq_len", "256", "--training.global_batch_size", "64"]), world_size=8)
    validate(parse_config(["--parallelism.context_parallel_degree", "2", "--compile.enable", "--compile.fullgraph",
                           "false", "--training.seq_len", "256"]), world_size=2)


@pytest.mark.parametrize("argv, where", [
    (["--training.device", "cpu"], "a hola block on cpu (training.device cpu)"),
    (["--model.flavour", "gdn", "--training.device", "cpu"], "a gdn block on cpu (training.device cpu)"),
    (["--model.attention_backend", "reference", "--training.device", "cuda"],
     "on cuda (model.attention_backend reference)"),
])
def test_fullgraph_compile_of_the_reference_token_mixer_is_refused_before_the_build(argv, where, capsys):
    """The reference backend stays out of torch.compile (compiler.disable), so a fullgraph block cannot compile:
    refused in one line naming both compile keys and the device, in validate and so in the preflight."""
    argv = ["--training.seq_len", "256", "--compile.enable", *argv]
    _invalid("compile.fullgraph", argv, match=where)
    _invalid("compile.fullgraph", argv, match="compile.enable")
    assert preflight_main(["--dry-run", *argv]) == 2
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("error: compile.fullgraph: ") and where in line
    # Without fullgraph the rest of each block compiles around the eager token mixer; Transformer++ compiles whole.
    validate(parse_config([*argv, "--compile.fullgraph", "false"]), world_size=1)
    validate(parse_config([*argv, "--model.flavour", "transformer"]), world_size=1)


def test_validate_checks_programmatic_configs():
    config = parse_config(["--training.seq_len", "256"])
    config.training.steps = -1
    with pytest.raises(ConfigError, match="^training.steps: "):
        validate(config, world_size=1)
    config.training.steps = "ten"
    with pytest.raises(ConfigError, match="^training.steps: expected int, got 'ten'"):
        validate(config, world_size=1)


# ---- resolved config ---------------------------------------------------------------------------------------------


def test_resolved_config_round_trips(tmp_path):
    config = parse_config([
        "--job.config_file", str(TRAIN_CONFIGS[0]), "--job.description", 'quote " backslash \\ tab \t é',
        "--model.window", "16", "--optimizer.lr", "1.5e-4", "--optimizer.eps", "1e-12",
        "--float8.filter_fqns", "output,head", "--training.global_batch_size", "64", "--optimizer.fused", "false",
    ])
    path = write_resolved(config, tmp_path / "run")
    assert path == tmp_path / "run" / "config.toml"
    assert load_toml(path) == config
    assert load_toml(write_resolved(JobConfig(), tmp_path / "defaults")) == JobConfig()
    assert "None" not in path.read_text()


def test_to_dict_covers_every_key():
    table = to_dict(JobConfig())
    assert list(table) == list(SECTIONS) and "dry_run" not in table
    assert table["optimizer"]["betas"] == [0.9, 0.95] and table["model"]["window"] is None


# ---- train_configs -----------------------------------------------------------------------------------------------


def test_train_configs_exist():
    names = {p.name for p in TRAIN_CONFIGS}
    assert {"debug_model.toml", "hola_340M.toml", "hola_recency_340M.toml", "gdn_340M.toml", "transformer_340M.toml",
            "hola_1.3B.toml", "hola_7B.toml"} <= names


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("world_size", [1, 8])
def test_train_config_parses_and_validates(path, world_size, tmp_path):
    assert path.read_text().startswith("# ")
    config = parse_config(["--job.config_file", str(path)])
    validate(config, world_size=world_size)
    assert load_toml(write_resolved(config, tmp_path)) == config


def test_340M_configs_differ_only_in_flavour():
    configs = {p.name: to_dict(load_toml(p)) for p in TRAIN_CONFIGS if p.name.endswith("_340M.toml")}
    assert len(configs) == 4
    for table in configs.values():
        table["model"].pop("flavour")
        table.pop("job")
    first = next(iter(configs.values()))
    assert all(table == first for table in configs.values())
    hola = load_toml(TRAIN_CONFIGS[0].parent / "hola_340M.toml")
    degrees = resolve_degrees(hola.parallelism, hola.training, world_size=8)
    assert degrees.global_batch_size * hola.training.seq_len == 256 * 2048


def test_the_46M_recipes_differ_only_in_the_mixer():
    """The paper's ablation size for HOLA, HOLA+recency, GDN and Transformer++ (train_configs/<flavour>_46M.toml):
    the same data, schedule and sizes; only the flavour and where the run is written differ."""
    from hola_titan.config import flat_items

    items = {}
    for flavour in ("hola", "hola_recency", "gdn", "transformer"):
        config = parse_config(["--job.config_file", str(TRAIN_CONFIGS[0].parent / f"{flavour}_46M.toml")])
        assert config.model.flavour == flavour and config.model.size == "46M"
        assert config.training.seq_len == 4096 and config.data.dataset == "data/corpus_100m"
        items[flavour] = {k: v for k, v in flat_items(config).items()
                          if k not in ("model.flavour", "job.dump_folder", "job.description", "job.config_file")}
    assert all(other == items["hola"] for other in items.values())
