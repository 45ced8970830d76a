"""The lm-eval model `dllm_jax` (dllm_jax.eval): lm-eval itself runs a local task in GSM8K's
format on the demo, `generate_until` gives `decoding.generate`'s tokens for every method,
AR log-likelihoods are exact, and the diffusion ELBO is LLaDA's Monte-Carlo estimate.

Nothing is downloaded: the task is a YAML (`dataset_path: json`) and a JSONL written here,
the checkpoints are the demo and tiny ones in LLaDA's and LLaMA's published layouts.
"""

import functools
import json
import os
import re
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
import lm_eval.evaluator
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from dllm_jax import decoding
from dllm_jax.checkpoints import testing as ckt
from dllm_jax.decoding import base, buckets, registry
from dllm_jax.eval import DllmJaxLM, likelihood, parse_model_args
from dllm_jax.generate import UsageError
from dllm_jax.models import transformer
from dllm_jax.sampler import cut_at_stop, decode_text, encode_text
import tiny_llada

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.usefixtures("compile_cache")

TASK = "gsm8k_local"
STRICT = r"#### (\-?[0-9\.\,]+)"
FLEXIBLE = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
generation_kwargs:
  until: ["Question:"]
  do_sample: false
num_fewshot: 0
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "{strict}"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "{flexible}"
      - function: take_first
metadata:
  version: 1.0
"""


def write_task(directory, questions, task=TASK):
  """A GSM8K-format JSONL ({"question", "answer": "... #### N"}) and its lm-eval YAML."""
  directory.mkdir(parents=True, exist_ok=True)
  data = directory / f"{task}.jsonl"
  data.write_text("".join(json.dumps({"question": q, "answer": f"{q}{a}\n#### {a}"}) + "\n"
                          for q, a in questions))
  esc = lambda s: s.replace("\\", "\\\\")
  (directory / f"{task}.yaml").write_text(TASK_YAML.format(
      task=task, data=data, strict=esc(STRICT), flexible=esc(FLEXIBLE)))
  return directory


def questions(n=16, seed=0):
  """n two-digit additions; every fourth answer is wrong on purpose, so the score is < 1."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    a, b = (int(x) for x in rng.integers(0, 100, 2))
    out.append((f"{a}+{b}=", a + b + (7 if i % 4 == 3 else 0)))
  return out


def own_score(text: str, answer: int, pattern: str, last: bool) -> bool:
  """GSM8K's filters restated: the first (strict) or last (flexible) regex match, with
  commas, $ and a final period ignored, equals the answer."""
  matches = re.findall(pattern, text)
  if not matches:
    return False
  match = matches[-1 if last else 0]
  value = next(g for g in match if g) if isinstance(match, tuple) else match
  return re.sub(r"[,$]|\.$", "", value) == str(answer)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
  return write_task(tmp_path_factory.mktemp("tasks"), questions())


def instance(context, gen_kwargs=None, kind="generate_until", task="t", idx=0):
  args = (context, gen_kwargs or {}) if kind == "generate_until" else context
  return Instance(kind, {}, args, idx, (task, idx, 1))


# --- lm-eval on the local task ---------------------------------------------------------


@pytest.fixture
def quick_lm_eval(monkeypatch):
  """lm-eval without its environment report (torch's collect_env runs pip and nvidia-smi in
  subprocesses: seconds that test nothing of ours)."""
  monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)


def local_tasks(task_dir):
  """A TaskManager of the test's tasks only (indexing lm-eval's thousands takes ~10 s)."""
  return TaskManager(include_path=str(task_dir), include_defaults=False)


def test_exact_match_equals_own_count(demo_cache, task_dir, quick_lm_eval):
  """simple_evaluate's exact match (both filters) is the test's own count over the same
  responses' decode, and the speed in the results counts their response tokens and NFE."""
  results = lm_eval.simple_evaluate(
      model="dllm_jax", model_args="checkpoint=demo,method=ar,batch_size=16", tasks=[TASK],
      task_manager=local_tasks(task_dir), log_samples=True, torch_random_seed=None)
  qs = questions()
  lm = DllmJaxLM(checkpoint="demo", method="ar")
  ordered = sorted(range(len(qs)), key=lambda i: -len(encode_text(lm.tokenizer, qs[i][0])))
  out = lm.sampler.sample([qs[i][0] for i in ordered], stop=["Question:"], seed=1234,
                          return_output=True)
  texts = dict(zip(ordered, out.text))
  strict = sum(own_score(texts[i], a, STRICT, last=False) for i, (_, a) in enumerate(qs))
  flexible = sum(own_score(texts[i], a, FLEXIBLE, last=True) for i, (_, a) in enumerate(qs))
  scores = results["results"][TASK]
  assert scores["exact_match,flexible-extract"] == pytest.approx(flexible / len(qs))
  assert scores["exact_match,strict-match"] == pytest.approx(strict / len(qs))
  assert 8 <= flexible <= 12   # the demo adds well; a quarter of the answers are wrong
  assert {s["doc_id"]: s["resps"][0][0] for s in results["samples"][TASK]} == texts

  speed = results["config"]["dllm_jax"]["speed"]["per_task"][TASK]
  assert speed["prompts"] == 16 and speed["decodes"] == 1
  assert speed["response_tokens"] == int(out.lengths.sum()) and speed["nfe"] == out.nfe
  assert speed["tokens_per_forward"] == pytest.approx(out.lengths.sum() / (out.nfe * 16))
  assert speed["tokens_per_s"] == pytest.approx(speed["response_tokens"] / speed["wall_s"])


CHOICE_YAML = """task: arith_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def test_multiple_choice_accuracy_equals_own_argmax(demo_cache, tmp_path, quick_lm_eval):
  """lm-eval scores choices with the model's loglikelihood: the demo's masked-diffusion
  model through the ELBO (deterministic per request), its accuracy the test's own argmax."""
  docs = []
  for i, (q, a) in enumerate(questions(6, seed=1)):
    right = str(a - (7 if i % 4 == 3 else 0))
    choices = [right, str(int(right) + 1), str(int(right) + 10)]
    docs.append({"question": q, "choices": choices[i % 3:] + choices[:i % 3],
                 "label": (3 - i % 3) % 3})
  data = tmp_path / "arith_choice.jsonl"
  data.write_text("".join(json.dumps(d) + "\n" for d in docs))
  (tmp_path / "arith_choice.yaml").write_text(CHOICE_YAML.format(data=data))
  lm = DllmJaxLM(checkpoint="demo", method="llada", mc_num=16, mc_batch_size=16)
  results = lm_eval.simple_evaluate(model=lm, tasks=["arith_choice"],
                                    task_manager=local_tasks(tmp_path), torch_random_seed=None)
  correct = 0
  for d in docs:
    scores = lm.loglikelihood([instance((d["question"], c), kind="loglikelihood")
                               for c in d["choices"]])
    correct += int(np.argmax([s for s, _ in scores]) == d["label"])
  assert results["results"]["arith_choice"]["acc,none"] == pytest.approx(correct / len(docs))
  assert correct >= 4
  assert results["config"]["dllm_jax"]["likelihood"] == "elbo"


# --- generate_until == decoding.generate, every method ----------------------------------

PROMPTS = ["12+34=", "7+5=", "99+98=", "3+41="]
UNTIL = {0: ["1"], 1: []}   # two groups of two ragged prompts: one batch bucket


def reference_texts(sampler, ids, until, seed):
  """`decoding.generate` on the prompts as Sampler pads them, cut at EOS and `until`."""
  tokens, valid = base.pad_prompts(ids, base.output_pad_id(sampler.cfg),
                                   length=max(max(map(len, ids)), sampler.prompt_len or 0))
  out = jax.device_get(decoding.generate(sampler.params, sampler.cfg, (tokens, valid),
                                         method=sampler.method, rng=jax.random.key(seed),
                                         **sampler.options))
  texts = [cut_at_stop(decode_text(sampler.tokenizer, out.tokens[i, :out.lengths[i]]),
                       until)[0] for i in range(len(ids))]
  return texts, int(out.lengths.sum()), int(out.nfe)


@pytest.mark.parametrize("method", registry.names())
def test_generate_until_equals_generate_demo(demo_cache, method):
  lm = DllmJaxLM(checkpoint="demo", method=method, batch_size=2, seed=5)
  requests = [instance(p, {"until": UNTIL[i % 2], "max_gen_toks": 64})
              for i, p in enumerate(PROMPTS)]
  texts = lm.generate_until(requests)
  tokens = nfe = 0
  for group in (0, 1):
    rows = [i for i in range(len(PROMPTS)) if i % 2 == group]
    rows.sort(key=lambda i: -len(PROMPTS[i]))   # the harness's order: longest first
    ids = [encode_text(lm.tokenizer, PROMPTS[i]) for i in rows]
    want, n_tokens, n_fe = reference_texts(lm.sampler, ids, UNTIL[group], seed=5)
    assert [texts[i] for i in rows] == want, method
    tokens, nfe = tokens + n_tokens, nfe + n_fe
  speed = lm.get_model_info()["dllm_jax"]["speed"]["per_task"]["t"]
  assert (speed["response_tokens"], speed["nfe"], speed["decodes"]) == (tokens, nfe, 2)
  assert lm.sampler.options["gen_length"] == 8    # the demo's answer canvas wins over 64


# --- tiny checkpoints in the published layouts -----------------------------------------

SPECIALS = ["<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|startoftext|>"]
TEMPLATE = ("{{ '<|startoftext|>' }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
            "<|end_header_id|>{{ m['content'] }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
            "{% endif %}")
HEADS, KV_HEADS = 4, 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """{"llada": dir, "llama": dir, "w": their neutral weights}: one BPE tokenizer (the chat
  template writes BOS), LLaDA's layout (bidirectional, [MASK]) and LLaMA's (causal)."""
  root = tmp_path_factory.mktemp("tiny")
  backend = tiny_llada.train_bpe(SPECIALS)
  vocab, ids = backend.get_vocab_size(), backend.token_to_id
  out = {}
  for name, seed in (("llada", 0), ("llama", 1)):
    path = root / name
    w = ckt.random_weights(vocab=vocab, d=32, layers=2, heads=HEADS, kv_heads=KV_HEADS,
                           mlp=64, seed=seed)
    if name == "llada":
      config = ckt.llada_config(w, heads=HEADS, kv_heads=KV_HEADS,
                                mask_token_id=ids("<|mdm_mask|>"),
                                eos_token_id=ids("<|endoftext|>"), max_sequence_length=128)
      ckt.write_tensors(path, ckt.llada_tensors(w), config)
    else:
      config = ckt.qwen_config(w, heads=HEADS, kv_heads=KV_HEADS, model_type="llama",
                               eos_token_id=ids("<|endoftext|>"),
                               bos_token_id=ids("<|startoftext|>"),
                               max_position_embeddings=128)
      ckt.write_tensors(path, ckt.qwen_tensors(w), config)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
        "mask_token": "<|mdm_mask|>", "chat_template": TEMPLATE}))
    out[name], out[f"w_{name}"] = path, w
  return out


CHAT = [{"role": "user", "content": "What is a module?"}]


@pytest.mark.parametrize("name,method,extra", [
    ("llada", "llada", {"steps": 8, "block_length": 8}),
    ("llada", "fast_dllm", {"block_length": 4, "threshold": 0.5}),
    ("llama", "ar", {}),
    ("llama", "speculative", {"drafter": "d2f", "draft_length": 4}),
])
def test_generate_until_equals_generate_checkpoints(tiny, name, method, extra):
  """Chat-templated (as lm-eval asks) and raw prompts of HF-layout checkpoints: the template
  writes BOS once, and the tokens are `decoding.generate`'s."""
  args = dict(checkpoint=str(tiny[name]), method=method, batch_size=2, gen_length=8, **extra)
  if method == "speculative":
    args["drafter_model"] = str(tiny["llada"])
  lm = DllmJaxLM(**args)
  chat = lm.apply_chat_template(CHAT)
  assert chat.count("<|startoftext|>") == 1 and lm.chat_template(True) == TEMPLATE
  prompts = [chat, "The module system"]
  texts = lm.generate_until([instance(p) for p in prompts])
  ids = [lm.tokenizer.apply_chat_template(CHAT, tokenize=True),
         encode_text(lm.tokenizer, prompts[1])]
  assert ids[0].count(lm.tokenizer.bos_token_id) == 1
  order = sorted(range(2), key=lambda i: -len(ids[i]))
  want, tokens, _ = reference_texts(lm.sampler, [ids[i] for i in order], (), seed=1234)
  assert [texts[i] for i in order] == want
  assert tokens == lm.speed.tasks["t"].response_tokens


def test_ar_loglikelihood_is_exact(tiny):
  """Sum of log-softmax of the continuation tokens under the causal forward, computed here
  one request at a time without padding; greedy iff each is the argmax."""
  lm = DllmJaxLM(checkpoint=str(tiny["llama"]), method="ar", batch_size=2)
  tok, params, cfg = lm.tokenizer, lm.sampler.params, lm.cfg
  pairs = [("The module", " system"), ("", "hello world"), ("import the ", "module"),
           ("What is", " a")]

  forward = jax.jit(functools.partial(transformer.forward, attention="causal"),
                    static_argnums=1)

  def direct(context, continuation):
    if context:
      whole = tok.encode(context.rstrip() + context[len(context.rstrip()):] + continuation)
      head = tok.encode(context.rstrip())
    else:
      head, whole = [tok.bos_token_id], [tok.bos_token_id] + tok.encode(continuation)
    seq = np.asarray(head + whole[len(head):])
    logits = forward(params, cfg, jnp.asarray(seq[None]))
    logp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)))
    cols = range(len(head), len(seq))
    return (sum(logp[j - 1, seq[j]] for j in cols),
            all(logp[j - 1].argmax() == seq[j] for j in cols))

  got = lm.loglikelihood([instance(p, kind="loglikelihood") for p in pairs])
  for (context, continuation), (logprob, greedy) in zip(pairs, got):
    want, want_greedy = direct(context, continuation)
    assert logprob == pytest.approx(want, rel=1e-5, abs=1e-4) and greedy == want_greedy

  # Rolling: within the window one pass over the whole text from the prefix token; with a
  # small window the sum over lm-eval's disjoint windows, each scored the same way.
  text = "The module system is the way to import names. " * 2
  ids = tok.encode(text)
  whole = lm.loglikelihood_rolling([instance((text,), kind="loglikelihood_rolling")])[0]
  assert whole == pytest.approx(direct("", text)[0], rel=1e-5)
  small = DllmJaxLM(checkpoint=str(tiny["llama"]), method="ar", batch_size=4, max_length=16)
  windows = list(map(lm_eval.utils.make_disjoint_window, lm_eval.utils.get_rolling_token_windows(
      ids, prefix_token=tok.bos_token_id, max_seq_len=15, context_len=1)))
  assert len(windows) > 2
  rolled = small.loglikelihood_rolling([instance((text,), kind="loglikelihood_rolling")])[0]
  want = 0.0
  for context, continuation in windows:
    seq = jnp.asarray([context + continuation])
    logp = np.asarray(jax.nn.log_softmax(forward(params, cfg, seq)[0]))
    start = len(context)
    want += float(sum(logp[j - 1, int(seq[0, j])] for j in range(start, seq.shape[1])))
  assert rolled == pytest.approx(want, rel=1e-5)


def test_elbo_equals_numpy_restatement(tiny):
  """The harness's diffusion log-likelihood is LLaDA's estimator over the masks and times
  `mc_masks` draws, restated in NumPy on the float64 reference forward."""
  mc_num, b = 8, 4
  lm = DllmJaxLM(checkpoint=str(tiny["llada"]), method="llada", mc_num=mc_num,
                 mc_batch_size=b, seed=3)
  context, continuation = "The module", " system is the way"
  (logprob, greedy), = lm.loglikelihood([instance((context, continuation),
                                                   kind="loglikelihood")])
  assert greedy is False
  tok = lm.tokenizer
  whole, head = tok.encode(context + continuation), tok.encode(context)
  seq, length = np.asarray(whole), len(whole) - len(head)
  padded = buckets.bucket(len(seq), "pow2", low=buckets.MIN_PROMPT_BUCKET)
  width = min(buckets.bucket(length, "pow2"), padded - 1)
  masked, counts = jax.device_get(likelihood.mc_masks(
      likelihood.request_key(3, seq.tolist()), length, width=width, num_batches=mc_num // b,
      batch=b))
  masked = masked[..., width - length:]        # the continuation's columns
  for n in range(mc_num // b):                  # LLaDA's spread of mask counts over a batch
    k = counts[n, 0]
    assert counts[n].tolist() == [(round(k + i * length / b) - 1) % length + 1
                                  for i in range(b)]
    np.testing.assert_array_equal(masked[n].sum(-1), counts[n])
  losses = []
  for n in range(mc_num // b):
    total = 0.0
    for i in range(b):
      canvas = seq.copy()
      slots = len(head) + np.flatnonzero(masked[n, i])
      canvas[slots] = lm.cfg.mask_token_id
      logits = ckt.reference_logits(tiny["w_llada"], canvas[None], heads=HEADS,
                                    kv_heads=KV_HEADS, rope_theta=500000.0, eps=1e-5,
                                    causal=False)[0]
      logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
      ce = logz[slots] - logits[slots, seq[slots]]
      total += ce.sum() / (counts[n, i] / length)
    losses.append(total / b)
  assert logprob == pytest.approx(-np.mean(losses), rel=1e-4)


def test_elbo_within_three_standard_errors(tiny):
  """A 64-sample estimate lies within 3 standard errors of a 4096-sample one (batch means
  are independent, so each estimate's error is std(batch losses) / sqrt(batches))."""
  lm = DllmJaxLM(checkpoint=str(tiny["llada"]), method="llada")
  seq = lm.tokenizer.encode("The module system is the way to import")
  tokens, valid = lm._padded([seq])
  length = 6

  def estimate(mc_num, mc_batch, seed):
    losses = np.asarray(likelihood.diffusion_elbo(
        lm.sampler.params, tokens[0], valid[0], length, jax.random.key(seed), cfg=lm.cfg,
        width=8, mc_num=mc_num, mc_batch=mc_batch))
    return -losses.mean(), losses.std(ddof=1) / np.sqrt(len(losses))

  small, small_se = estimate(64, 8, seed=0)
  big, big_se = estimate(4096, 64, seed=1)
  assert big_se < small_se / 3
  assert abs(small - big) <= 3 * np.hypot(small_se, big_se)


# --- model args, errors and the command line ---------------------------------------------


def test_model_args():
  args = parse_model_args("checkpoint=/ckpt/x,method=fast_dllm,threshold=0.8,cache=dual,"
                          "batch_size=8,mesh={\"fsdp\": 2, \"data\": 1},mc_num=64")
  assert (args.checkpoint, args.method, args.batch_size, args.mc_num) == (
      "/ckpt/x", "fast_dllm", 8, 64)
  assert args.options == {"threshold": 0.8, "cache": "dual"}
  assert args.mesh == {"fsdp": 2, "data": 1}
  assert parse_model_args({"checkpoint": "demo", "early_stop": "false"}).options == {
      "early_stop": False}
  for bad, message in [("method=ar", "checkpoint"), ("checkpoint=demo,method=nope", "nope"),
                       ("checkpoint=/x,method=speculative", "drafter_model"),
                       ("checkpoint=demo,method=ar,drafter_model=/x", "drafter_model"),
                       ("checkpoint=demo,batch_size=auto", "auto"),
                       ("checkpoint=demo,mc_num=10,mc_batch_size=4", "multiple"),
                       ("checkpoint=demo,likelihood=exact", "likelihood")]:
    with pytest.raises(UsageError, match=message):
      parse_model_args(bad)


def test_batch_size_and_block_causal_likelihood(demo_cache):
  """lm-eval's --batch_size applies unless the model args set it; a block-causal method
  names the likelihood to choose instead of guessing one."""
  lm = DllmJaxLM.create_from_arg_obj({"checkpoint": "demo", "method": "d2f"},
                                     {"batch_size": 4, "device": None})
  assert lm.batch_size == 4
  lm = DllmJaxLM.create_from_arg_string("checkpoint=demo,method=d2f,batch_size=2",
                                        {"batch_size": 4})
  assert lm.batch_size == 2 and lm.get_model_info()["dllm_jax"]["likelihood"] is None
  with pytest.raises(ValueError, match="likelihood=elbo"):
    lm.loglikelihood([instance(("1+1=", "2"), kind="loglikelihood")])
  again = DllmJaxLM.from_sampler(lm.sampler, batch_size=3, tau_conf=0.5, likelihood="elbo")
  assert again.batch_size == 3 and again.sampler.options["tau_conf"] == 0.5
  assert again.likelihood == "elbo" and again.sampler.params is lm.sampler.params


def _cli(*argv, timeout=600):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "dllm_jax.eval", *argv], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_cli_user_errors_are_one_line(tmp_path):
  """Checked before lm-eval or JAX start: one `error:` line, exit status 2."""
  for argv, message in [
      (["--model_args", "checkpoint=demo,method=nope", "--tasks", TASK], "nope"),
      (["--model_args", f"checkpoint={tmp_path}/missing", "--tasks", TASK], "does not exist"),
      (["-a", "checkpoint=demo", "-a", "mc_num=3", "--tasks", TASK], "mc_num")]:
    proc = _cli(*argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_writes_scores_and_speed(demo_cache, task_dir, tmp_path):
  """`python -m dllm_jax.eval` is lm-eval's CLI with the model filled in: its results JSON
  holds the score and, beside it, the decode's speed."""
  proc = _cli("--model_args", "checkpoint=demo,method=d2f,batch_size=16", "--tasks", TASK,
              "--include_path", str(task_dir), "--output_path", str(tmp_path / "out"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert re.search(r"\[dllm_jax\] d2f gsm8k_local: 16 prompts, \d+ response tokens", proc.stderr)
  (path,) = (tmp_path / "out").rglob("results_*.json")
  results = json.loads(path.read_text())
  assert 0.5 <= results["results"][TASK]["exact_match,flexible-extract"] < 1
  speed = results["config"]["dllm_jax"]["speed"]["per_task"][TASK]
  assert speed["response_tokens"] > 0 and speed["nfe"] > 0 and speed["tokens_per_s"] > 0
  assert results["config"]["dllm_jax"]["options"]["block_length"] == 4


def test_builtin_demo_task_is_found_by_name(tmp_path, monkeypatch):
  """`--tasks demo_sums` adds dllm_jax's own task directory (written once, absolute data
  path) to lm-eval's include path; lm-eval reads its 64 additions; a second --include_path
  is one clear error."""
  from dllm_jax.eval import __main__ as eval_cli
  from dllm_jax.eval import tasks as builtin
  monkeypatch.setenv("DLLM_JAX_CACHE", str(tmp_path))
  argv, _, _ = eval_cli.parse_cli(["--model_args", "checkpoint=demo", "--tasks", "demo_sums"])
  assert argv[-2:] == ["--include_path", str(tmp_path / "lm_eval_tasks")]
  manager = TaskManager(include_path=argv[-1], include_defaults=False)
  task = lm_eval.tasks.get_task_dict(["demo_sums"], manager)["demo_sums"]
  docs = list(task.test_docs())
  assert docs == builtin.demo_sums() and len(docs) == 64
  assert all(int(d["answer"].removeprefix("#### ")) == eval(d["question"][:-1]) for d in docs)
  argv, _, _ = eval_cli.parse_cli(["--model_args", "checkpoint=demo", "--tasks", TASK])
  assert "--include_path" not in argv
  with pytest.raises(ValueError, match="one --include_path"):
    eval_cli.parse_cli(["--model_args", "checkpoint=demo", "--tasks", "demo_sums",
                        "--include_path", str(tmp_path)])


def test_tasks_in_the_include_path_run_without_indexing_lm_evals_tasks(tmp_path, monkeypatch):
  """A run whose tasks are all tasks of its --include_path (dllm_jax's own, or the caller's)
  builds lm-eval's TaskManager from that path only (not lm-eval's ~14,000 task files); a
  name found only among lm-eval's tasks, or a group, keeps the full index, and the
  TaskManager is lm-eval's own again after the run."""
  from dllm_jax.eval import __main__ as eval_cli
  monkeypatch.setenv("DLLM_JAX_CACHE", str(tmp_path / "cache"))
  argv, _, _ = eval_cli.parse_cli(["--model_args", "checkpoint=demo", "--tasks", "demo_sums"])
  assert eval_cli.include_path_has_every_task(argv)
  tasks = write_task(tmp_path / "tasks", questions(4))
  (tasks / "both.yaml").write_text(f"group: both\ntask:\n  - {TASK}\n  - gsm8k\n")
  local = ["--include_path", str(tasks), "--tasks"]
  assert eval_cli.include_path_has_every_task([*local, TASK])
  assert not eval_cli.include_path_has_every_task([*local, f"{TASK},gsm8k"])
  assert not eval_cli.include_path_has_every_task([*local, "both"])  # a group: full index
  assert not eval_cli.include_path_has_every_task(["--tasks", "gsm8k"])
  with eval_cli.without_lm_eval_task_index():
    manager = lm_eval.tasks.TaskManager(include_path=argv[-1])
    assert "demo_sums" in manager.all_tasks and "gsm8k" not in manager.all_tasks
  assert lm_eval.tasks.TaskManager is TaskManager
