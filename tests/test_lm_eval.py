"""lm-evaluation-harness itself on a tiny export: its plain ``hf`` model with ``trust_remote_code=True``, local
tasks of the three request kinds (rolling log-likelihood, multiple choice, generation) at batch 2, checked against
the model's own numbers.

lm-eval is a dev dependency (``pip install -e .[dev]``); the tasks read local JSON files, so no hub access.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lm_eval  # noqa: E402  (a dev dependency: a missing one fails here rather than skipping)

from hola_titan.data import load_tokenizer  # noqa: E402
from hola_titan.eval.perplexity import count_words, encode_documents, score_documents, summarise  # noqa: E402
from hola_titan.export import save_pretrained  # noqa: E402
from hola_titan.models.args import model_args, replace  # noqa: E402
from hola_titan.models.model import ModelCache, build_model  # noqa: E402

TEXTS = ["The cat sat on the mat and looked at the door.",
         "A river runs through the old town, past the mill and under three bridges.",
         "Numbers: one two three four five six seven eight nine ten."]
REPO = Path(__file__).resolve().parents[1]
# The offline example task of docs/evaluation.md (its data path is relative to the repository's root).
LOCAL_TASK = REPO / "scripts" / "lm_eval_local"
QUESTIONS = [json.loads(line) for line in (LOCAL_TASK / "questions.jsonl").read_text().splitlines()]
PROMPTS = [{"prompt": "Once upon a time", "answer": " there"}, {"prompt": "The", "answer": " end"},
           {"prompt": "In the beginning of the story the", "answer": " dog"}]


def _task(name: str, data: str, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


# One pytest-xdist worker runs the module: its module-scoped fixtures are made once.
pytestmark = pytest.mark.xdist_group("test_lm_eval")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    tokenizer = load_tokenizer("bundled")
    args = replace(model_args("hola", "debug", vocab_size=tokenizer.vocab_size), n_layers=2, dim=64, head_dim=16,
                   mlp_hidden=128, block=4, window=3)
    torch.manual_seed(0)
    model = build_model(args, device="cpu")
    with torch.no_grad():  # off the init values, so that every parameter matters
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.eval()
    save_pretrained(model, tokenizer, root / "model")
    for name, rows in (("texts", [{"text": t} for t in TEXTS]), ("prompts", PROMPTS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "rolling.yaml").write_text(_task("ht_rolling", root / "texts.jsonl", (
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")))
    # The shipped task, with its data path made absolute (this process may run elsewhere than the repository).
    shipped = (LOCAL_TASK / "ht_choice.yaml").read_text()
    (tasks / "choice.yaml").write_text(shipped.replace("scripts/lm_eval_local/questions.jsonl",
                                                       str(LOCAL_TASK / "questions.jsonl")))
    (tasks / "generate.yaml").write_text(_task("ht_generate", root / "prompts.jsonl", (
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "target_delimiter: ''\ngeneration_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")))
    return model, tokenizer, root


_RUNS: dict = {}


def _run(root, batch_size: int) -> dict:
    """lm-eval's results for the export at ``root`` at ``batch_size`` (each evaluated once per test session). Batch
    2 alone: its numbers are checked against the model's own, which is what batch 1 would have to equal too."""
    from lm_eval.tasks import TaskManager

    key = (str(root), batch_size)
    if key not in _RUNS:
        _RUNS[key] = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={root / 'model'},trust_remote_code=True,dtype=float32,max_length=256",
            tasks=["ht_rolling", "ht_choice", "ht_generate"], batch_size=batch_size, device="cpu", log_samples=True,
            task_manager=TaskManager(include_path=str(root / "tasks"), include_defaults=False))
    return _RUNS[key]


def _samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_lm_eval_at_batch_2_matches_the_model_s_own_numbers(export):
    model, tokenizer, root = export
    results = _run(root, batch_size=2)

    # Rolling log-likelihood: lm-eval's per-document total equals hola_titan.eval's lm_eval convention.
    docs = encode_documents(TEXTS, tokenizer, convention="lm_eval")
    ours = [float(nll.sum()) for nll in score_documents(model, docs, show_progress=False)]
    theirs = [-s["filtered_resps"][0] for s in _samples(results, "ht_rolling")]
    assert theirs == pytest.approx(ours, rel=1e-5, abs=1e-4)
    bits = sum(ours) / math.log(2) / sum(len(t.encode()) for t in TEXTS)
    assert results["results"]["ht_rolling"]["bits_per_byte,none"] == pytest.approx(bits, rel=1e-5)
    # Word perplexity, the papers' "Wiki. ppl": lm-eval's count of words is ours.
    summary = summarise(docs, score_documents(model, docs, show_progress=False))
    assert summary["words"] == sum(count_words(t) for t in TEXTS)
    assert results["results"]["ht_rolling"]["word_perplexity,none"] == pytest.approx(summary["word_perplexity"],
                                                                                      rel=1e-5)

    # Multiple choice: each choice's log-likelihood is the model's log-probability of it after the question.
    for sample, doc in zip(_samples(results, "ht_choice"), QUESTIONS):
        context = tokenizer.encode(doc["q"])
        for (loglik, _), choice in zip((r[0] for r in sample["resps"]), doc["choices"]):
            whole = tokenizer.encode(doc["q"] + choice)
            assert whole[:len(context)] == context  # the split lm-eval makes, at the same token boundary
            with torch.no_grad():
                logp = F.log_softmax(model(torch.tensor([whole]))[0].double(), -1)
            expected = sum(float(logp[i - 1, whole[i]]) for i in range(len(context), len(whole)))
            assert loglik == pytest.approx(expected, rel=1e-5, abs=1e-4), (doc["q"], choice)

    # Generation at batch 2 (left-padded prompts of different lengths): each equals the prompt decoded alone.
    for sample, doc in zip(_samples(results, "ht_generate"), PROMPTS):
        ids = tokenizer.encode(doc["prompt"])
        cache = ModelCache()
        with torch.no_grad():
            logits = model(torch.tensor([ids]), cache=cache)
            out = []
            for _ in range(6):
                nxt = int(logits[0, -1].argmax())
                out.append(nxt)
                logits = model(torch.tensor([[nxt]]), cache=cache)
        expected = tokenizer.decode(out).split("\n\n")[0]
        assert sample["filtered_resps"][0] == expected, doc["prompt"]


def test_the_plain_lm_eval_command_opens_the_export_in_a_fresh_process(export, tmp_path):
    """``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True`` with nothing imported first: the
    folder's auto_map does what ``import hola_titan.hf_model`` did; the scores equal the in-process run's."""
    _, _, root = export
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    # docs/evaluation.md's offline example as written (the shipped task, run from the repository's root), beside the
    # generation task of this module.
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "ht_choice.yaml").write_text((LOCAL_TASK / "ht_choice.yaml").read_text())
    (tasks / "generate.yaml").write_text((root / "tasks" / "generate.yaml").read_text())
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
           f"pretrained={root / 'model'},trust_remote_code=True,dtype=float32,max_length=256", "--tasks",
           "ht_choice,ht_generate", "--include_path", str(tasks), "--batch_size", "2", "--device", "cpu",
           "--output_path", str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    written = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    expected = _run(root, batch_size=2)["results"]
    for task, metric in (("ht_choice", "acc,none"), ("ht_generate", "exact_match,none")):
        assert written[task][metric] == expected[task][metric], task


def test_generate_until_runs_the_static_decoder_and_matches_eager_steps(export):
    """lm-eval's own ``generate_until`` request path (``HFLM._model_generate``: ``max_length``, its stop-sequence
    criteria, ``pad_token_id``) with ``decode=buffers`` in the model arguments, greedy and sampled, at batch 2:
    every batch's tokens (spied on ``_model_generate``'s result) and every string equal those of
    ``decode=eager``, a stop sequence cuts generation short, and the fast run's ``ht_generate`` scores equal the
    default run's."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    _, _, root = export
    prompts = [p["prompt"] for p in PROMPTS] + ["A"]
    runs = {}
    for decode in ("eager", "buffers"):
        lm = HFLM(pretrained=str(root / "model"), trust_remote_code=True, dtype="float32", max_length=256,
                  batch_size=2, device="cpu", decode=decode)
        tokens = []
        generate = lm._model_generate

        def spy(*args, generate=generate, tokens=tokens, **kwargs):
            out = generate(*args, **kwargs)
            tokens.append((out.clone(), out.shape[1] - kwargs["context"].shape[1]))
            return out

        lm._model_generate = spy
        texts, paths = [], []
        # "o" ends every batch within a few tokens; "\n\n" never comes: all 16 tokens.
        for options, seed in (({"do_sample": False, "until": ["o"]}, 0), ({"do_sample": False, "until": ["\n\n"]}, 0),
                              ({"do_sample": True, "temperature": 0.7, "until": ["o", "\n\n"]}, 4)):
            requests = [Instance("generate_until", {}, (p, {"max_gen_toks": 16, **options}), i)
                        for i, p in enumerate(prompts)]
            torch.manual_seed(seed)
            texts.append(lm.generate_until(requests, disable_tqdm=True))
            paths.append(lm.model.generate_path)
        runs[decode] = (tokens, texts, paths, lm)
    (eager_tokens, eager_texts, eager_paths, _), (tokens, texts, paths, lm) = runs["eager"], runs["buffers"]
    assert [p["decode"] for p in eager_paths] == ["eager"] * 3
    assert [p["decode"] for p in paths] == ["buffers"] * 3 and paths[1]["reused"] and paths[1]["steps"] == 15
    assert texts == eager_texts and len(tokens) == len(eager_tokens) == 6
    for (got, new), (want, _) in zip(tokens, eager_tokens):
        assert torch.equal(got, want)
    assert min(new for _, new in tokens) < 16  # the stop sequence ended a batch early

    fast = lm_eval.simple_evaluate(model=lm, tasks=["ht_generate"], log_samples=True,
                                   task_manager=TaskManager(include_path=str(root / "tasks"), include_defaults=False))
    default = _run(root, batch_size=2)
    assert lm.model.generate_path["decode"] == "buffers"
    assert [s["filtered_resps"] for s in _samples(fast, "ht_generate")] == [
        s["filtered_resps"] for s in _samples(default, "ht_generate")]
