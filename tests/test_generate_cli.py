"""`python -m dllm_jax.generate` on tiny checkpoints written in the published layouts and on a
tiny training run; every user mistake is one `error:` line and exit status 2."""

import json
import math
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from dllm_jax import checkpoints, decoding, generate
from dllm_jax.checkpoints import testing as ckt
from dllm_jax.sampler import Sampler
from _jax_cache_env import compilation_cache_env
from _no_jax import env_without_jax
import tiny_llada

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Programs compiled here go to the session's persistent compilation cache, which
# test_experiments_script_is_the_cli passes on to the script it starts.
pytestmark = pytest.mark.usefixtures("compile_cache")

SPECIALS = ["<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>", "<|start_header_id|>",
            "<|end_header_id|>"]
TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
            "{{ m['content'] }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
            "{% endif %}")


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
  """A tiny LLaDA checkpoint with a BPE tokenizer, chat template and a PEFT adapter."""
  path = tmp_path_factory.mktemp("llada")
  backend = tiny_llada.train_bpe(SPECIALS)
  backend.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "eos_token": "<|endoftext|>", "mask_token": "<|mdm_mask|>", "chat_template": TEMPLATE}))
  vocab = backend.get_vocab_size()
  w = ckt.random_weights(vocab=vocab, d=32, layers=2, heads=4, kv_heads=4, mlp=64)
  ckt.write_tensors(path / "model", ckt.llada_tensors(w), ckt.llada_config(
      w, heads=4, kv_heads=4, mask_token_id=backend.token_to_id("<|mdm_mask|>"),
      eos_token_id=backend.token_to_id("<|endoftext|>"), max_sequence_length=256))
  for f in ("tokenizer.json", "tokenizer_config.json"):
    (path / "model" / f).write_bytes((path / f).read_bytes())
  rng = np.random.default_rng(0)
  factors = {f"model.transformer.blocks.{i}.{m}": (
      rng.standard_normal((4, 32)).astype(np.float32) * 0.1,
      rng.standard_normal((32, 4)).astype(np.float32) * 0.1)
      for i in range(2) for m in ("q_proj", "k_proj", "v_proj", "attn_out")}
  ckt.write_peft_adapter(path / "adapter", factors, r=4, alpha=4.0,
                         target_modules=["q_proj", "k_proj", "v_proj", "attn_out"])
  return path


@pytest.mark.parametrize("method,opts", [
    ("d2f", ["block_length=4", "tau_conf=0.5"]),
    ("llada", ["block_length=8", "steps=8"]),
])
def test_cli_generates_with_adapter(llada_dir, capsys, method, opts):
  argv = ["--model", str(llada_dir / "model"), "--adapter", str(llada_dir / "adapter"),
          "--method", method, "--prompt", "What is a module?", "--gen_length", "16",
          "--dtype", "float32", "--json"]
  for o in opts:
    argv += ["--opt", o]
  assert generate.main(argv) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report["method"] == method and report["nfe"] >= 1
  assert 0 <= report["response_tokens"] <= 16

  # The CLI's answer is what the library gives for the same chat-formatted prompt.
  cfg, params = checkpoints.load_pretrained(llada_dir / "model", dtype="float32",
                                            adapter_dir=llada_dir / "adapter")
  tok = checkpoints.load_tokenizer(llada_dir / "model")
  text = tok.apply_chat_template([{"role": "user", "content": "What is a module?"}])
  kw = {k: v for k, v in (generate._parse_opt(o) for o in opts)}
  out = decoding.generate(params, cfg, [tok.encode(text, add_special_tokens=False)],
                          method=method, gen_length=16, **kw)
  expected = tok.decode(np.asarray(out.tokens[0, :out.lengths[0]]).tolist(),
                        skip_special_tokens=True)
  assert report["answers"] == [expected]
  assert report["nfe"] == int(out.nfe)


def test_cli_speculative_with_a_drafter_model(llada_dir, capsys):
  """--drafter_model loads the drafter; the answer is `decoding.generate`'s (greedy: the
  target's AR tokens); a drafting method without a drafter is a one-line error."""
  model = str(llada_dir / "model")
  argv = ["--model", model, "--method", "speculative", "--prompt", "What is a module?",
          "--gen_length", "8", "--dtype", "float32", "--json", "--opt", "drafter=ar",
          "--opt", "draft_length=2"]
  assert generate.main(argv + ["--drafter_model", model]) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  cfg, params = checkpoints.load_pretrained(llada_dir / "model", dtype="float32")
  tok = checkpoints.load_tokenizer(llada_dir / "model")
  prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is a module?"}]),
                      add_special_tokens=False)
  out = decoding.generate(params, cfg, [prompt], method="speculative", gen_length=8,
                          drafter="ar", draft_length=2, drafter_params=params, drafter_cfg=cfg)
  ar = decoding.generate(params, cfg, [prompt], method="ar", gen_length=8)
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  assert report["answers"] == [tok.decode(np.asarray(out.tokens[0, :out.lengths[0]]).tolist(),
                                          skip_special_tokens=True)]
  assert report["nfe"] == int(out.nfe)
  _fails(capsys, argv, "--method speculative drafts with a second model", "--drafter_model")
  _fails(capsys, argv[:3] + ["adaptive"] + argv[4:], "--method adaptive", "--drafter_model")
  _fails(capsys, ["--model", model, "--method", "llada", "--prompt", "x", "--drafter_model",
                  model], "--drafter_model applies to --method speculative or adaptive")


def test_parse_value():
  parse = generate.parse_value
  assert parse("4") == 4 and isinstance(parse("4"), int)
  assert parse("0.9") == 0.9 and parse("1e-3") == 1e-3
  assert math.isnan(parse("nan")) and parse("inf") == math.inf and parse("-inf") == -math.inf
  assert parse("true") is True and parse("False") is False and parse("none") is None
  assert parse("dual") == "dual" and parse("(1, 2)") == (1, 2)


def _fails(capsys, argv, *needles):
  """The CLI exits 2 with exactly one stderr line `error: ...` holding every needle."""
  assert generate.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: "), err
  for needle in needles:
    assert needle in err[0], err[0]
  return err[0]


@pytest.fixture(scope="module")
def fake_workdir(tmp_path_factory, tiny_config):
  """A training workdir that has not saved a checkpoint yet."""
  from dllm_jax.training import config as config_lib
  path = tmp_path_factory.mktemp("run")
  (path / "config.json").write_text(config_lib.to_json(tiny_config("mdm")))
  (path / "checkpoints").mkdir()
  return path


def test_user_errors_are_one_line(llada_dir, fake_workdir, tmp_path, capsys):
  model = str(llada_dir / "model")
  base = ["--model", model, "--prompt", "x", "--gen_length", "8", "--method", "llada"]
  _fails(capsys, ["--model", str(tmp_path / "nope"), "--prompt", "x"], "does not exist")
  _fails(capsys, base + ["--mesh", "{tensor: 8}"], "--mesh", "not JSON", '{"tensor": 8}')
  _fails(capsys, base + ["--mesh", "[8]"], "JSON object")
  _fails(capsys, base[:-1] + ["beam"], "--method 'beam' is unknown", "d2f")
  _fails(capsys, base + ["--opt", "stpes=8"], "stpes", "steps")
  _fails(capsys, ["--model", model, "--prompt", "x", "--method", "d2f", "--gen_length", "8",
                  "--opt", "block_length=4", "--opt", "tau_conf=nan"], "tau_conf")
  _fails(capsys, base + ["--prompt", "word " * 300], "exceeds the model window")
  _fails(capsys, ["--workdir", model, "--prompt", "x"], "HF checkpoint", "not a training workdir")
  _fails(capsys, ["--model", str(fake_workdir), "--adapter", str(llada_dir / "adapter"),
                  "--prompt", "x"], "adapter applies to HF checkpoints", "training workdir")
  _fails(capsys, ["--model", str(fake_workdir), "--prompt", "x"], "no finished checkpoint")
  with pytest.raises(ValueError, match=r"is a training workdir .*, not a HF checkpoint"):
    Sampler.load(fake_workdir, "llada", kind="hf")
  _fails(capsys, ["--model", model, "--step", "3", "--prompt", "x"], "step=3")
  (tmp_path / "weightless").mkdir()
  (tmp_path / "weightless" / "config.json").write_text("{}")
  _fails(capsys, ["--model", str(tmp_path / "weightless"), "--prompt", "x"], "no *.safetensors")
  with pytest.raises(SystemExit) as e:  # argparse's own usage errors: status 2 as well
    generate.main(["--prompt", "x"])
  assert e.value.code == 2


def test_debug_shows_the_traceback(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    generate.main(["--model", str(tmp_path / "nope"), "--prompt", "x", "--debug"])


def test_method_names_are_the_decoders():
  """The CLI checks --method against the registry before JAX loads: the registry's drafter
  flags must be what its decoder classes say."""
  from dllm_jax.decoding import registry
  assert set(registry.drafter_methods()) == {
      m for m in registry.names() if registry.get(m).uses_drafter}
  assert all("drafter_params" in decoding.option_names(m) for m in registry.drafter_methods())
  assert set(registry.ranking_methods()) == {
      m for m in registry.names() if "batch_invariant" in decoding.option_names(m)}


def test_batch_invariant_flag_reaches_the_sampler():
  """--batch_invariant is the option batch_invariant=True, passed through to the decoder."""
  args = generate.build_parser().parse_args(
      ["--preset", "tiny", "--method", "llada", "--prompt", "x", "--batch_invariant"])
  assert generate.make_sampler(args).options["batch_invariant"] is True
  args = generate.build_parser().parse_args(["--preset", "tiny", "--method", "llada",
                                             "--prompt", "x"])
  assert "batch_invariant" not in generate.make_sampler(args).options


@pytest.mark.parametrize("flags, expected", [
    (["--method", "beam"], "error: --method 'beam' is unknown; use one of ['adaptive', 'ar',"),
    (["--model", "ckpt", "--method", "speculative"],  # the demo brings its own drafter
     "error: --method speculative drafts with a second model"),
    (["--drafter_model", "d"], "error: --drafter_model applies to --method speculative or"),
    (["--method", "ar", "--batch_invariant"],
     "error: --batch_invariant applies to the methods that rank confidences"),
    (["--mesh", "{tensor: 8}"], "error: --mesh '{tensor: 8}' is not JSON"),
    (["--mesh", '{"tensr": 8}'], "error: --mesh names unknown axes ['tensr']; the axes are"),
    (["--methd", "d2f"], "error: unrecognized arguments: --methd d2f"),  # argparse's
    (["--help"], "one of ['adaptive', 'ar', 'block_diffusion', 'd2f', 'dream'"),
])
def test_flag_mistakes_are_reported_before_jax_loads(tmp_path, flags, expected):
  """A mistake the flags alone show is one line (exit 2) from a process that cannot import
  JAX: it is reported before JAX and the model load, not seconds later."""
  argv = ["--model", "demo", "--prompt", "37+48="] + flags
  proc = subprocess.run([sys.executable, "-m", "dllm_jax.generate", *argv], cwd=tmp_path,
                        env=env_without_jax(tmp_path), capture_output=True, text=True,
                        timeout=120)
  if flags == ["--help"]:
    assert proc.returncode == 0 and expected in " ".join(proc.stdout.split()), proc.stderr
    return
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  lines = proc.stderr.strip().splitlines()
  assert expected in lines[-1], proc.stderr[-2000:]
  if not flags[0].startswith("--methd"):  # argparse prints its usage above its error line
    assert len(lines) == 1, proc.stderr


def test_demo_hybrids_need_no_drafter_flag():
  """`--model demo` brings a drafter for every method that drafts with one; any other model
  still needs --drafter_model."""
  from dllm_jax.decoding import registry
  for method in registry.drafter_methods():
    for model, ok in (("demo", True), ("/ckpt/target", False)):
      args = generate.build_parser().parse_args(["--model", model, "--method", method,
                                                 "--prompt", "37+48="])
      if ok:
        assert generate.check_args(args) is None
      else:
        with pytest.raises(generate.UsageError, match="--drafter_model DIR"):
          generate.check_args(args)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_config):
  """A few-step block-diffusion run (a workdir with a checkpoint and a block-size layout)."""
  from dllm_jax.training import trainer
  path = tmp_path_factory.mktemp("bd_run") / "run"
  trainer.train(tiny_config("block_diffusion", block_size=4), path)
  return path


def test_workdir_decodes_with_its_layout(trained_run, capsys):
  """`--workdir RUN` (experiments/generate.py crashed on it) == the run's own eval decode."""
  from dllm_jax.training import checkpoint, data as data_lib
  model = checkpoint.load_params(trained_run)
  tok = data_lib.make_tokenizer(model.config.data)
  layout = data_lib.make_layout(model.config.data, tok)
  enc = layout.encode_prompts(["12+34=", "5+6="])
  g = layout.seq_len - layout.prompt_len
  cfg = model.model_cfg.replace(active_vocab_size=tok.vocab_size)
  out = decoding.generate(model.params, cfg, (enc["tokens"], enc["valid"]),
                          method="block_diffusion", gen_length=g,
                          block_length=4, steps_per_block=4)
  expected = [tok.decode(np.asarray(out.tokens)[i, :int(out.lengths[i])]) for i in range(2)]

  sampler = Sampler.load(trained_run, "block_diffusion")
  assert sampler.options["gen_length"] == g and sampler.prompt_len == layout.prompt_len
  np.testing.assert_array_equal(sampler.encode(["12+34=", "5+6="])[0], enc["tokens"])
  assert sampler.sample(["12+34=", "5+6="]) == expected
  for flag in ("--workdir", "--model"):
    assert generate.main([flag, str(trained_run), "--method", "block_diffusion", "--prompt",
                          "12+34=", "--prompt", "5+6=", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["answers"] == expected
  _fails(capsys, ["--model", str(trained_run), "--dtype", "float32", "--prompt", "1+1="],
         "dtype='float32'", "training workdir")
  _fails(capsys, ["--model", str(trained_run), "--prompt", "1?1="], "'?'")


@pytest.mark.slow
def test_experiments_script_is_the_cli(trained_run):
  """experiments/generate.py --workdir RUN runs the same CLI (it crashed before)."""
  # The reference first: with the persistent compilation cache (pytestmark) passed on, the
  # script loads this decode program instead of compiling it again.
  expected = Sampler.load(trained_run, "llada").sample(["12+34="])
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **compilation_cache_env())
  proc = subprocess.run([sys.executable, "experiments/generate.py", "--workdir",
                         str(trained_run), "--method", "llada", "--prompt", "12+34=", "--json"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  assert report["answers"] == expected
  bad = subprocess.run([sys.executable, "experiments/generate.py", "--workdir",
                        str(trained_run), "--mesh", "{", "--prompt", "x"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --mesh")
  assert len(bad.stderr.strip().splitlines()) == 1
