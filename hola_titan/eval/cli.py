"""The evaluation command line: ``python -m hola_titan.eval EVAL (--checkpoint SPEC | --compare SPEC ...) ...``.

Evals: ``ppl`` (perplexity), ``generate`` (text from a prompt, and decoding memory at several context lengths),
``niah`` (RULER-style needles) and ``mqar`` (associative recall). ``SPEC`` is an exported folder or
``init:<flavour>[:<size>]`` (``hola_titan.eval.loading``); with ``--compare`` it may also be a result JSON written
earlier by the same eval. Outputs go to ``--out`` (``hola_titan.eval.report`` names and writes the files), checked
before any model is loaded. Mistakes, and an output that cannot be written, print one line ``error: ...`` naming the
path and the cause and exit with status 2; ``--help`` after an eval lists its options.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hola_titan.eval import report
from hola_titan.eval.loading import LoadedModel, label_of, load_model
from hola_titan.eval.runtime import (EvalError, format_length, parse_int, parse_length, parse_list, parse_percent,
                                     resolve_device, resolve_dtype)
from hola_titan.kernels.runtime.tuned_configs import CHOICE_HELP
from hola_titan.runfolder import FolderUnusableError, check_writable_folder

EVALS = ("ppl", "generate", "niah", "mqar", "cache")


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` whose usage errors are one line, ``error: <message>``, with exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _typed(parse: Callable):
    """An argparse ``type`` from a parser that raises :class:`EvalError`."""
    def convert(text: str):
        try:
            return parse(text)
        except EvalError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _lengths(text: str) -> list[int]:
    return parse_list(text, parse_length, what="lengths")


def _optional_lengths(text: str) -> list[int]:
    return [] if text.strip().lower() in ("", "none") else _lengths(text)


def _depths(text: str) -> list[float]:
    return parse_list(text, parse_percent, what="depths")


def _ints(text: str) -> list[int]:
    values = parse_list(text, parse_int, what="values")
    if min(values) < 1:
        raise EvalError(f"expected positive integers, got {text!r}")
    return values


def _niah_tasks(text: str) -> list[str]:
    from hola_titan.eval.niah import TASKS

    names = list(TASKS) if text.strip() == "all" else parse_list(text, str.strip, what="tasks")
    for name in names:
        if name not in TASKS:
            raise EvalError(f"unknown NIAH task {name!r}; expected one of {', '.join(TASKS)} or all")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m hola_titan.eval", description="Evaluate hola-titan checkpoints: "
                           "perplexity, generation and decoding memory, RULER-style needles, MQAR.")
    evals = parser.add_subparsers(dest="eval", required=True, metavar="EVAL", parser_class=OneLineParser)

    common = OneLineParser(add_help=False)
    which = common.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="exported model folder, or init:<flavour>[:<size>]")
    which.add_argument("--compare", nargs="+", metavar="SPEC",
                       help="evaluate several checkpoints (or read result JSONs) and write a comparison table")
    common.add_argument("--out", default="outputs/eval", help="folder for the JSON, PNG and comparison files")
    common.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    common.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="model dtype (default: bfloat16 on CUDA, float32 on CPU)")
    common.add_argument("--seed", type=int, default=0, help="seed of samples, prompts and sampling")
    common.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    common.add_argument("--kernel-configs", default="auto", help=CHOICE_HELP.replace("fla's", "The kernels'", 1))
    common.add_argument("--threads", type=int, default=None,
                        help="CPU threads for PyTorch (default: its own choice; 1 is fastest for tiny models)")

    ppl = evals.add_parser("ppl", parents=[common], help="perplexity and bits per byte on held-out text")
    ppl.add_argument("--data", default="bundled",
                     help="bundled, a local .txt/.jsonl/.json/.parquet file, folder or glob, or a HF hub dataset")
    ppl.add_argument("--split", default="validation")
    ppl.add_argument("--text-field", default="text")
    ppl.add_argument("--dataset-config", default=None, help="hub dataset configuration")
    ppl.add_argument("--txt-documents", default="paragraph", choices=("paragraph", "file"),
                     help=".txt files: a document per blank-line-separated paragraph, or per file")
    ppl.add_argument("--window", type=int, default=0,
                     help="sliding window in tokens; 0 (default): the whole document as context")
    ppl.add_argument("--stride", type=int, default=None, help="sliding-window stride (default: the window)")
    ppl.add_argument("--chunk", type=int, default=2048, help="tokens per forward call (full-context mode)")
    ppl.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    ppl.add_argument("--max-documents", type=int, default=None, help="stop after this many documents")
    ppl.add_argument("--convention", default="hola_titan", choices=("hola_titan", "lm_eval"),
                     help="which tokens are targets: as in training (tokens 2..n and the closing EOS; default) or "
                          "as lm-eval's rolling log-likelihood (EOS prefix, tokens 1..n, no closing EOS)")
    ppl.add_argument("--cache", default="on", choices=("on", "off"),
                     help="off: every layer's cache gate forced to zero at test time (what the state path predicts "
                          "alone: the cache-off ablation); HOLA flavours only")

    gen = evals.add_parser("generate", parents=[common],
                           help="generate from a prompt; measure decoding memory at several context lengths")
    gen.add_argument("--prompt", default="Once upon a time", help="prompt text")
    gen.add_argument("--prompt-file", default=None, help="read the prompt from this file instead")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0: no nucleus cut")
    gen.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill call (0: one)")
    gen.add_argument("--decode", default="auto", choices=("auto", "eager", "buffers", "graph", "compile"),
                      help="decoding steps: auto (compile for HOLA/GDN on CUDA, else eager), eager (through the "
                           "cache object), buffers, graph or compile (hola_titan.decoding)")
    gen.add_argument("--memory-lengths", type=_typed(_optional_lengths), default=[1024, 8192],
                     help="context lengths for the memory measurement, e.g. 1k,32k ('none' to skip)")
    gen.add_argument("--memory-new-tokens", type=int, default=32, help="tokens decoded after each memory prefill")

    niah = evals.add_parser("niah", parents=[common], help="RULER-style needle-in-a-haystack accuracy")
    niah.add_argument("--tasks", type=_typed(_niah_tasks), default="all",
                      help="comma-separated: s_niah_1, s_niah_2, s_niah_3, mk_niah, mv_niah, mq_niah, or all")
    niah.add_argument("--lengths", type=_typed(_lengths), default=[1024, 2048, 4096],
                      help="prompt lengths in tokens, e.g. 1k,2k,4k,8k,16k,32k,64k,128k")
    niah.add_argument("--depths", type=_typed(_depths), default=[0.0, 25.0, 50.0, 75.0, 100.0],
                      help="needle depths in percent")
    niah.add_argument("--samples", type=int, default=4, help="samples per task, length and depth")
    niah.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    niah.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill call (0: one)")
    niah.add_argument("--decode", default="auto", choices=("auto", "eager", "buffers", "graph", "compile"),
                      help="decoding steps: auto (compile for HOLA/GDN on CUDA, else eager), eager (through the "
                           "cache object), buffers, graph or compile (hola_titan.decoding)")
    niah.add_argument("--haystack", default="bundled",
                      help="natural-text haystack source (split train): bundled or a local text dataset")

    mqar = evals.add_parser("mqar", parents=[common], help="multi-query associative recall accuracy")
    mqar.add_argument("--pairs", type=_typed(_ints), default=[4, 8, 16, 32, 64], help="numbers of key-value pairs")
    mqar.add_argument("--seq-lens", type=_typed(_lengths), default=[256], help="sequence lengths")
    mqar.add_argument("--samples", type=int, default=256, help="sequences per point")
    mqar.add_argument("--batch-size", type=int, default=64)
    mqar.add_argument("--vocab", type=int, default=None, help="MQAR vocabulary (default: the model's)")
    mqar.add_argument("--power-a", type=float, default=0.01, help="query placement exponent (as in training)")
    mqar.add_argument("--cache", default="on", choices=("on", "off"),
                      help="off: every layer's cache gate forced to zero at test time (the recall the state "
                           "path holds alone); HOLA flavours only")

    cache = evals.add_parser("cache", parents=[common],
                             help="which positions each layer's HOLA cache selects over an MQAR row, by token kind, "
                                  "or over the longest documents of a text (--data): how old the held entries are")
    cache.add_argument("--data", default=None,
                       help="text mode: a local .txt/.jsonl/.json/.parquet file, folder or glob, bundled, or a hub "
                            "dataset (as for ppl); its --max-documents longest documents are read")
    cache.add_argument("--split", default="validation", help="text mode: the split of --data")
    cache.add_argument("--text-field", default="text", help="text mode: the field holding the text")
    cache.add_argument("--dataset-config", default=None, help="text mode: hub dataset configuration")
    cache.add_argument("--max-documents", type=int, default=4, help="text mode: the longest documents to read")
    cache.add_argument("--max-tokens", type=int, default=65536, help="text mode: tokens read of each document")
    cache.add_argument("--pairs", type=int, default=16, help="key-value pairs of the row")
    cache.add_argument("--seq-len", type=int, default=256, help="tokens of the row")
    cache.add_argument("--vocab", type=int, default=None, help="MQAR vocabulary (default: the model's)")
    cache.add_argument("--power-a", type=float, default=0.01, help="query placement exponent (as in training)")
    return parser


# ---------------------------------------------------------------------------------------------------------------
# The evaluations: each takes the loaded model and the arguments, returns (settings, summary, details)
# ---------------------------------------------------------------------------------------------------------------


def _warn_length(loaded: LoadedModel, length: int, what: str) -> None:
    """Transformer++ runs at any length (RoPE is computed on the fly) but was trained up to ``max_seq_len``."""
    args = loaded.model.args
    if not args.is_recurrent and length > args.max_seq_len:
        print(f"warning: {loaded.label}: {what} {length} is beyond the Transformer++ training length "
              f"{args.max_seq_len}; results there measure length extrapolation", file=sys.stderr)


def _apply_cache_choice(loaded: LoadedModel, cache: str) -> None:
    """``--cache off`` (ppl, mqar): every layer's cache gate forced to zero; a model without a cache is refused."""
    from hola_titan.eval.mqar import switch_cache_off

    if cache == "off" and switch_cache_off(loaded.model) == 0:
        raise EvalError(f"--cache off: {loaded.model.args.flavour} has no cache to switch off")


def _read_text(loaded: LoadedModel, data: str, *, split: str, text_field: str, dataset_config: str | None,
               txt_documents: str, max_tokens: int | None, max_documents: int | None, convention: str):
    """``(documents, max_tokens)``: the documents of ``--data`` encoded (``perplexity.encode_documents``); from a
    hub dataset at most 2^20 tokens unless a bound is given. Errors name ``--data``."""
    from hola_titan.data.sources import hub_documents, read_documents, resolve_source
    from hola_titan.eval.perplexity import encode_documents

    try:
        source = resolve_source(data, split=split, text_field=text_field, dataset_config=dataset_config,
                                txt_documents=txt_documents)
    except (OSError, ValueError) as error:
        raise EvalError(f"--data {data!r}: {error}") from None
    if source.kind == "hub" and max_tokens is None and max_documents is None:
        max_tokens = 1 << 20
        print(f"note: hub dataset {data!r}: reading its first {max_tokens} tokens", file=sys.stderr)
    try:
        texts = read_documents(source) if source.kind != "hub" else hub_documents(source, streaming=True)
        documents = encode_documents(texts, loaded.tokenizer, max_tokens=max_tokens, max_documents=max_documents,
                                     convention=convention)
    except EvalError:
        raise
    except Exception as error:  # noqa: BLE001  (file, parquet and hub readers raise many kinds; all mean the same)
        raise EvalError(f"--data {data!r} cannot be read: {type(error).__name__}: {error}") from None
    if not documents:
        raise EvalError(f"--data {data!r}: no document with text")
    return documents, max_tokens


def run_ppl(loaded: LoadedModel, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    from hola_titan.eval.perplexity import score_documents, summarise

    if args.window < 0:
        raise EvalError(f"--window must be >= 0, got {args.window}")
    _apply_cache_choice(loaded, args.cache)
    documents, max_tokens = _read_text(loaded, args.data, split=args.split, text_field=args.text_field,
                                       dataset_config=args.dataset_config, txt_documents=args.txt_documents,
                                       max_tokens=args.max_tokens, max_documents=args.max_documents,
                                       convention=args.convention)
    window = args.window or None
    _warn_length(loaded, window or max(len(d.ids) for d in documents), "context length")
    nll = score_documents(loaded.model, documents, window=window, stride=args.stride, chunk=args.chunk,
                          show_progress=not args.no_progress)
    details = summarise(documents, nll)
    summary = {k: details[k] for k in ("perplexity", "loss", "bits_per_byte", "bits_per_token", "word_perplexity",
                                       "tokens_per_word", "tokens")}
    settings = {"data": args.data, "split": args.split, "window": window, "stride": args.stride,
                "chunk": args.chunk, "max_tokens": max_tokens, "max_documents": args.max_documents,
                "convention": args.convention, "cache": args.cache}
    return settings, summary, details


def run_generate(loaded: LoadedModel, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    from hola_titan.eval.generation import SamplingOptions, generate, measure_decoding_memory

    if args.max_new_tokens < 1 or args.memory_new_tokens < 1:
        raise EvalError("--max-new-tokens and --memory-new-tokens must be >= 1")
    prompt_text = args.prompt
    if args.prompt_file is not None:
        try:
            prompt_text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as error:
            raise EvalError(f"--prompt-file {args.prompt_file!r}: {error.strerror or error}") from None
    sampling = SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    sampling.check()
    tokenizer, model = loaded.tokenizer, loaded.model
    prompt_ids = tokenizer.encode(prompt_text)
    if not prompt_ids:
        raise EvalError("the prompt is empty")
    _warn_length(loaded, len(prompt_ids) + args.max_new_tokens, "prompt plus new tokens")
    device = next(model.parameters()).device
    result = generate(model, torch.tensor([prompt_ids], device=device), max_new_tokens=args.max_new_tokens,
                      sampling=sampling, prefill_chunk=args.prefill_chunk, stop_ids=(tokenizer.eos_id,),
                      show_progress=not args.no_progress, decode=args.decode)
    completion = tokenizer.decode(result.tokens[0])
    for length in args.memory_lengths:
        _warn_length(loaded, length, "memory context length")
    memory = measure_decoding_memory(model, lengths=args.memory_lengths, new_tokens=args.memory_new_tokens,
                                     prefill_chunk=args.prefill_chunk, seed=args.seed,
                                     show_progress=not args.no_progress, decode=args.decode)
    decode_steps = max(result.steps - 1, 1)
    details = {"prompt": prompt_text, "prompt_tokens": len(prompt_ids), "completion": completion,
               "completion_tokens": len(result.tokens[0]), "stopped_at_eos": result.finished[0],
               "prefill_seconds": result.prefill_seconds,
               "decode_tokens_per_s": decode_steps / max(result.decode_seconds, 1e-9),
               "cache_bytes": result.cache.nbytes(), "memory": memory, "decode_path": result.decode_path,
               "cache_bytes_constant": len({r["cache_bytes_after_decode"] for r in memory}) <= 1}
    summary = {"decode_tokens_per_s": details["decode_tokens_per_s"]}
    for row in memory:
        name = format_length(row["context_len"])
        summary[f"cache_MiB@{name}"] = row["cache_bytes_after_decode"] / 2**20
        summary[f"peak_MiB@{name}"] = row["peak_bytes"] / 2**20
    settings = {"prompt_file": args.prompt_file, "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                "prefill_chunk": args.prefill_chunk, "memory_lengths": args.memory_lengths,
                "memory_new_tokens": args.memory_new_tokens, "decode": args.decode}
    return settings, summary, details


def run_niah(loaded: LoadedModel, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    from hola_titan.eval.niah import evaluate_niah

    if args.samples < 1 or args.batch_size < 1:
        raise EvalError("--samples and --batch-size must be >= 1")
    tasks = args.tasks
    for length in args.lengths:
        _warn_length(loaded, length, "NIAH length")
    details = evaluate_niah(loaded.model, loaded.tokenizer, tasks=tasks, lengths=args.lengths, depths=args.depths,
                            samples_per_depth=args.samples, seed=args.seed, batch_size=args.batch_size,
                            prefill_chunk=args.prefill_chunk, haystack_source=args.haystack,
                            show_progress=not args.no_progress, decode=args.decode)
    settings = {"tasks": tasks, "lengths": args.lengths, "depths": args.depths, "samples": args.samples,
                "seed": args.seed, "haystack": args.haystack, "prefill_chunk": args.prefill_chunk,
                "decode": args.decode}
    return settings, details.pop("summary"), details


def run_mqar(loaded: LoadedModel, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    from hola_titan.eval.mqar import evaluate_mqar

    _apply_cache_choice(loaded, args.cache)

    details = evaluate_mqar(loaded.model, pairs=args.pairs, seq_lens=args.seq_lens, num_samples=args.samples,
                            vocab_size=args.vocab, power_a=args.power_a, batch_size=args.batch_size, seed=args.seed,
                            show_progress=not args.no_progress)
    settings = {"pairs": args.pairs, "seq_lens": args.seq_lens, "samples": args.samples,
                "vocab_size": details["vocab_size"], "power_a": args.power_a, "seed": args.seed, "cache": args.cache}
    return settings, details.pop("summary"), details


def run_cache(loaded: LoadedModel, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    from hola_titan.eval.cache_inspect import SHARES, inspect_mqar, inspect_text_cache

    if args.data is not None:
        if args.max_documents < 1:
            raise EvalError(f"--max-documents {args.max_documents}: need >= 1")
        block = loaded.model.args.block
        if args.max_tokens <= block:
            raise EvalError(f"--max-tokens {args.max_tokens}: need more than one block of {block} tokens")
        # Every document of the source is encoded to find the longest (a hub dataset: its first 2^20 tokens); those
        # of one block or less hold nothing a later block reads.
        documents, _ = _read_text(loaded, args.data, split=args.split, text_field=args.text_field,
                                  dataset_config=args.dataset_config, txt_documents="paragraph", max_tokens=None,
                                  max_documents=None, convention="hola_titan")
        longest = sorted((d.ids[:args.max_tokens] for d in documents if len(d.ids) > block), key=len,
                         reverse=True)[:args.max_documents]
        if not longest:
            raise EvalError(f"--data {args.data!r}: no document longer than one block of {block} tokens")
        _warn_length(loaded, len(longest[0]), "document length")
        details = inspect_text_cache(loaded.model, longest)
        summary = {}
        for name, layer in details["layers"].items():
            summary[f"early_share@layer{name}"] = layer["early_share"]
            summary[f"mean_relative_age@layer{name}"] = layer["mean_relative_age"]
        for name, layer in details["reads"]["layers"].items():
            summary.update({f"{share}@layer{name}": layer[share] for share in (*SHARES, "rebuilt_error")})
        settings = {"data": args.data, "split": args.split, "max_documents": args.max_documents,
                    "max_tokens": args.max_tokens}
        return settings, summary, details
    details = inspect_mqar(loaded.model, seq_len=args.seq_len, num_pairs=args.pairs, vocab_size=args.vocab,
                           power_a=args.power_a, seed=args.seed)
    summary = {}
    for name, layer in details["layers"].items():
        # Keys and values (of the context and of the queries): what recall needs the cache to hold.
        summary[f"kv_share@layer{name}"] = sum(layer["share"][k] for k in ("key", "value", "query", "answer"))
        summary[f"kv_base@layer{name}"] = sum(layer["base"][k] for k in ("key", "value", "query", "answer"))
    settings = {"pairs": args.pairs, "seq_len": args.seq_len, "vocab": args.vocab, "power_a": args.power_a,
                "seed": args.seed}
    return settings, summary, details


RUNNERS = {"ppl": run_ppl, "generate": run_generate, "niah": run_niah, "mqar": run_mqar, "cache": run_cache}


# ---------------------------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------------------------


def _print_result(result: dict) -> None:
    name, label, details, summary = result["eval"], result["label"], result["details"], result["summary"]
    if name == "ppl":
        print(f"ppl {label}: perplexity {summary['perplexity']:.3f}, loss {summary['loss']:.4f} nats/token, "
              f"{summary['bits_per_byte']:.4f} bits/byte, word perplexity {summary['word_perplexity']:.3f} "
              f"({summary['tokens_per_word']:.3f} tokens/word) over {summary['tokens']} tokens "
              f"({details['documents']} documents)")
    elif name == "generate":
        print(f"generate {label}: {details['prompt']!r} -> {details['completion']!r}")
        path = details.get("decode_path", {})
        print(f"  {details['decode_tokens_per_s']:.1f} tokens/s decoding ({path.get('decode', 'eager')}), cache "
              f"{details['cache_bytes']} bytes")
        for row in details["memory"]:
            print(f"  context {row['context_len']:>8}: cache {row['cache_bytes_after_decode']:>12,} bytes, peak "
                  f"{row['peak_bytes'] / 2**20:9.1f} MiB (+{row['peak_over_start_bytes'] / 2**20:.1f} MiB over start)"
                  f", prefill {row['prefill_tokens_per_s']:,.0f} tok/s, decode {row['decode_tokens_per_s']:,.1f} tok/s")
        if details["memory"]:
            state = "constant" if details["cache_bytes_constant"] else "growing"
            print(f"  cache size is {state} in context length")
    elif name == "cache" and details.get("mode") == "text":
        if details["layers"]:  # none for window 0
            print(f"cache {label}: held entries over {len(details['documents'])} documents "
                  f"({', '.join(map(str, details['documents']))} tokens): share from the first "
                  f"1/{details['early']} of the prefix (a uniform sample: {1 / details['early']:.3f}), mean relative "
                  "age (uniform: 0.5)")
        for layer, values in details["layers"].items():
            print(f"  {layer}: {values['early_share']:.3f}, {values['mean_relative_age']:.3f}; by reading position: "
                  + ", ".join(f"{b['from']}-{b['to']} {b['early_share']:.2f}" for b in values["bins"]))
        print(f"cache {label}: the read's softmax mass on the entries of earlier blocks, the in-block tokens and the "
              "sink, and |sigmoid(gate) o_cache| / |o_state|, from the second block on (the recomputed read's largest "
              "distance from the output that ran, relative):")
        for layer, values in details["reads"]["layers"].items():
            print(f"  {layer}: {values['persistent']:.3f}, {values['block']:.3f}, {values['sink']:.3f}; "
                  f"{values['cache_to_state']:.3f} ({values['rebuilt_error']:.1e})")
    elif name == "cache":
        print(f"cache {label}: share of selected slots holding keys, values, queries or answers (base rate):")
        for key in summary:
            if key.startswith("kv_share@"):
                layer = key.split("@", 1)[1]
                print(f"  {layer}: {summary[key]:.3f} ({summary['kv_base@' + layer]:.3f})")
    elif name == "niah":
        for task, values in details["tasks"].items():
            cells = ", ".join(f"{length} {acc:.2f}" for length, acc in values["accuracy_by_length"].items())
            print(f"niah {label} {task}: {cells} (mean {values['accuracy']:.3f})")
    else:
        for point in details["points"]:
            print(f"mqar {label}: seq_len {point['seq_len']:>5} pairs {point['pairs']:>4}: accuracy "
                  f"{point['accuracy']:.3f} (sequences {point['sequence_accuracy']:.3f})")
        for skip in details["skipped"]:
            print(f"mqar {label}: skipped pairs {skip['pairs']} at seq_len {skip['seq_len']} (needs 4 x pairs)")


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------


def _unique_labels(specs: list[str]) -> list[str]:
    labels, seen = [], {}
    for spec in specs:
        base = label_of(spec)
        seen[base] = seen.get(base, 0) + 1
        labels.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
    return labels


def _is_result_file(spec: str) -> bool:
    """A result JSON written earlier, which ``--compare`` reads as it is (no model, no kernels)."""
    return spec.endswith(".json") and Path(spec).is_file()


def install_kernel_configs(choice: str, device: torch.device):
    """The launch configurations of fla's and our Triton kernels, as training takes them (``model.kernel_configs``),
    installed before any kernel launches: without them every kernel autotunes at its first launch of each new
    shape (the likely reason a 46M HOLA or GDN model's held-out perplexity took 115-187 s on an H100 where
    Transformer++'s took 20 s)."""
    from hola_titan.kernels.runtime import tuned_configs

    if choice not in ("auto", "off") and not Path(choice).expanduser().is_file():
        raise EvalError(f"--kernel-configs {choice!r}: expected auto, off or a file written by "
                        "scripts/tune_kernels.py; no such file")
    try:
        installed = tuned_configs.install(choice, device)
    except (OSError, ValueError, ImportError) as error:
        raise EvalError(f"--kernel-configs {choice!r}: {error}") from None
    print(f"kernel configurations: {installed.describe()}", flush=True)
    return installed


def paths_of(loaded: LoadedModel, device: torch.device, dtype: torch.dtype, installed) -> dict:
    """Which paths the evaluation ran, for its result file: the recurrent layers' backend and the kernels' launch
    configurations."""
    # What was served so far in this process (a --compare's later models include the earlier ones' launches);
    # paths inside the repository as <repo>/... (a result file is shared; where the repository sits is not).
    repo = str(Path(__file__).resolve().parents[2])
    paths = {"kernel_configs": {k: v.replace(repo, "<repo>") if isinstance(v, str) else v
                                for k, v in installed.record().items()}}
    args = loaded.model.args
    if args.is_recurrent:
        from hola_titan.kernels.dispatch import explain_backend
        backend, why = explain_backend("auto", device, head_dim=args.head_dim, dtype=dtype)
        paths["attention_backend"] = f"{backend} ({why})"
    return paths


def evaluate_one(spec: str, label: str, args: argparse.Namespace, device: torch.device,
                 dtype: torch.dtype, installed=None) -> dict:
    """Run ``args.eval`` on one checkpoint, or read a result JSON; write its JSON and PNG. ``installed``: what
    :func:`install_kernel_configs` chose (None: nothing installed)."""
    out = Path(args.out)
    if _is_result_file(spec):
        return report.read_result(Path(spec), eval_name=args.eval)
    loaded = load_model(spec, device=device, dtype=dtype, seed=args.seed)
    if args.eval in ("mqar", "ppl") and args.cache == "off":
        label += "-cache-off"  # beside the cache-on result, not over it
    loaded.label = label
    start = time.perf_counter()
    settings, summary, details = RUNNERS[args.eval](loaded, args)
    result = {"eval": args.eval, "checkpoint": spec, "label": label, "model": loaded.describe(),
              "device": str(device), "dtype": str(dtype).removeprefix("torch."), "settings": settings,
              "seconds": time.perf_counter() - start, "summary": summary, "details": details}
    if installed is not None:
        result["paths"] = paths_of(loaded, device, dtype, installed)
    del loaded
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    json_path = report.write_json(result, out / f"{args.eval}_{label}.json")
    png_path = report.PLOTS[args.eval](result, out / f"{args.eval}_{label}.png")
    _print_result(result)
    print(f"wrote {json_path} and {png_path}")
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise EvalError(f"--threads must be >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        # Before any model is loaded: an --out that cannot hold files would otherwise be found after the eval ran.
        check_writable_folder(args.out, key="--out")
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        specs = args.compare if args.compare else [args.checkpoint]
        # Nothing to install when every spec is an earlier result file (--compare reads them as they are).
        installed = None if all(map(_is_result_file, specs)) else install_kernel_configs(args.kernel_configs, device)
        results = [evaluate_one(spec, label, args, device, dtype, installed)
                   for spec, label in zip(specs, _unique_labels(specs))]
        if args.compare:
            table = report.comparison(results)
            out = Path(args.out)
            markdown = report.markdown_table(table)
            print(markdown)
            report.write_json(table, out / f"{args.eval}_compare.json")
            report.write_file(markdown + "\n", out / f"{args.eval}_compare.md")
            written = [out / f"{args.eval}_compare.json", out / f"{args.eval}_compare.md"]
            if args.eval in report.COMPARE_PLOTS:
                written.append(report.COMPARE_PLOTS[args.eval](results, out / f"{args.eval}_compare.png"))
            print("wrote " + ", ".join(map(str, written)))
    except (EvalError, FolderUnusableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
