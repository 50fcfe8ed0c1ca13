"""Hugging Face parity: GPT-2, Llama, Mistral, BERT and T5 built by ``transformers`` with random
weights (nothing is downloaded) are saved, converted, and must give the same logits (1e-4,
float32, with attention=reference and xla) and the same greedy tokens; export gives back
identical tensors that ``transformers`` loads; a converted run restores through ``load_run``;
what cannot be expressed fails naming the field."""

import dataclasses
import json
import math
import os

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers_jax.config import ModelConfig  # noqa: E402
from transformers_jax.convert import (  # noqa: E402
    ConversionError,
    HFTokenizer,
    convert_hf_directory,
    export_run,
    hf_logits,
    load_converted_run,
    load_hf,
    main,
    save_hf,
)
from transformers_jax.convert import bert as bert_convert  # noqa: E402
from transformers_jax.convert import gpt2 as gpt2_convert  # noqa: E402
from transformers_jax.convert import llama as llama_convert  # noqa: E402
from transformers_jax.convert import t5 as t5_convert  # noqa: E402
from transformers_jax.convert.hf_files import read_safetensors, write_safetensors  # noqa: E402
from transformers_jax.models import build_model  # noqa: E402
from transformers_jax.registry import MLPS  # noqa: E402
from transformers_jax.runs import load_run  # noqa: E402
from transformers_jax.sample import SamplingConfig, generate  # noqa: E402

ATOL = 1e-4
TOKENS = np.random.default_rng(0).integers(0, 101, (2, 16))


def save_model(model, directory, edit_config=None):
    model.save_pretrained(directory)
    if edit_config:  # hand-written configs (old spellings) as found on the Hub
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            data = json.load(f)
        edit_config(data)
        with open(path, "w") as f:
            json.dump(data, f)
    return str(directory)


def make_gpt2(directory, seed=0, **changes):
    torch.manual_seed(seed)
    fields = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                  initializer_range=0.2, bos_token_id=None, eos_token_id=None)
    config = transformers.GPT2Config(**{**fields, **changes})
    return save_model(transformers.GPT2LMHeadModel(config).eval(), directory)


def make_llama(directory, seed=0, edit_config=None, **changes):
    torch.manual_seed(seed)
    fields = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2,
                  rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config = transformers.LlamaConfig(**{**fields, **changes})
    return save_model(transformers.LlamaForCausalLM(config).eval(), directory, edit_config)


def hf_model(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                             dtype=torch.float32).eval()


_REFERENCE_LOGITS: dict = {}


def reference_logits(directory, tokens):
    with torch.no_grad():
        return hf_model(directory)(torch.as_tensor(tokens)).logits.numpy()


def memoised_reference_logits(directory, tokens):
    """``reference_logits`` of a module fixture's directory (never rewritten), computed once
    for the attention settings that share it."""
    key = (str(directory), np.asarray(tokens).tobytes())
    if key not in _REFERENCE_LOGITS:
        _REFERENCE_LOGITS[key] = reference_logits(directory, tokens)
    return _REFERENCE_LOGITS[key]


def our_logits(converted, tokens, attention="xla"):
    config = converted.config.replace(attention=attention)
    return np.asarray(build_model(config).apply({"params": converted.params}, jnp.asarray(tokens)))


def assert_parity(directory, tokens, attention, shared=False):
    """``shared``: ``directory`` is a module fixture's, so its reference logits are memoised."""
    converted = load_hf(directory)
    want = (memoised_reference_logits if shared else reference_logits)(directory, tokens)
    got = our_logits(converted, tokens, attention)
    assert want.std() > 0.1  # logits big enough for an absolute tolerance to mean something
    diff = np.max(np.abs(got - want))
    assert diff < ATOL, f"max |logit difference| {diff}"
    return converted


def llama3(factor=8.0, original=16):
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original,
            "rope_theta": 500000.0}


def legacy_rope_keys(data):
    """Llama 3.1's config.json spelling: rope_scaling (with "type" aliases) and rope_theta."""
    params = data.pop("rope_parameters")
    data["rope_theta"] = params.pop("rope_theta")
    data["rope_scaling"] = params


LLAMA_VARIANTS = {
    "mha_untied": dict(),
    "gqa_llama3_tied": dict(num_key_value_heads=2, tie_word_embeddings=True,
                            rope_parameters=llama3()),
    "gqa_llama3_untied": dict(num_key_value_heads=2, rope_parameters=llama3(factor=4.0)),
    "mqa_linear": dict(num_key_value_heads=1,
                       rope_parameters={"rope_type": "linear", "factor": 2.0,
                                        "rope_theta": 10000.0}),
    "yarn": dict(num_key_value_heads=2, max_position_embeddings=32,
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                  "original_max_position_embeddings": 8}),
    # the sequence (16) is longer than max_position_embeddings (8): the base really stretches
    "dynamic": dict(max_position_embeddings=8,
                    rope_parameters={"rope_type": "dynamic", "factor": 3.0,
                                     "rope_theta": 10000.0}),
    "biases_head_dim": dict(attention_bias=True, mlp_bias=True, head_dim=8,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
}


def make_mistral(directory, seed=0, **changes):
    torch.manual_seed(seed)
    fields = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  initializer_range=0.2, sliding_window=6, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    config = transformers.MistralConfig(**{**fields, **changes})
    return save_model(transformers.MistralForCausalLM(config).eval(), directory)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return make_mistral(tmp_path_factory.mktemp("mistral"))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return make_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    dirs = {name: make_llama(tmp_path_factory.mktemp(name), **changes)
            for name, changes in LLAMA_VARIANTS.items()}
    dirs["legacy_rope_scaling"] = make_llama(
        tmp_path_factory.mktemp("legacy"), edit_config=legacy_rope_keys,
        num_key_value_heads=2, rope_parameters=llama3())
    return dirs


# Logit parity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", [pytest.param("reference", marks=pytest.mark.slow), "xla"])
def test_gpt2_logits_match_transformers(gpt2_dir, attention):
    converted = assert_parity(gpt2_dir, TOKENS, attention, shared=True)
    cfg = converted.config
    assert (cfg.position.name, cfg.norm.name, cfg.mlp.name, cfg.tie_embeddings,
            cfg.use_bias) == ("learned", "layernorm", "gelu", True, True)


@pytest.mark.slow
def test_gpt2_untied_relu_unscaled_logits_match(tmp_path):
    directory = make_gpt2(tmp_path, tie_word_embeddings=False, activation_function="relu",
                          scale_attn_weights=False, n_inner=96, initializer_range=0.05)
    converted = assert_parity(directory, TOKENS, "xla")
    assert converted.config.attention_scale == 1.0 and converted.config.d_ff == 96


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["reference", "xla"])
@pytest.mark.parametrize("variant", [*LLAMA_VARIANTS, "legacy_rope_scaling"])
def test_llama_logits_match_transformers(llama_dirs, variant, attention):
    converted = assert_parity(llama_dirs[variant], TOKENS, attention, shared=True)
    cfg = converted.config
    assert (cfg.position.name, cfg.norm.name, cfg.mlp.name) == ("rope", "rmsnorm", "swiglu")
    expected_scaling = {"gqa_llama3_tied": "llama3", "gqa_llama3_untied": "llama3",
                        "legacy_rope_scaling": "llama3", "mqa_linear": "linear", "yarn": "yarn",
                        "dynamic": "dynamic_ntk"}.get(variant, "none")
    assert cfg.position.scaling.name == expected_scaling
    assert cfg.kv_heads == (LLAMA_VARIANTS.get(variant, {}).get("num_key_value_heads")
                            or (2 if variant == "legacy_rope_scaling" else 4))


@pytest.mark.slow
def test_llama_with_a_tanh_gelu_gate_is_our_geglu(tmp_path):
    """The MLP comes from the registry by its Hugging Face activation: a Llama whose gate is
    the tanh GELU (as Gemma's) is our ``geglu``, logits equal, and exports back."""
    directory = make_llama(tmp_path / "source", hidden_act="gelu_pytorch_tanh")
    converted = assert_parity(directory, TOKENS, "xla")
    assert converted.config.mlp.name == "geglu"
    hf = llama_convert.config_to_hf(converted.config, None)
    assert hf["hidden_act"] == "gelu_new"  # the registry's first spelling of the same function


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["reference", "xla"])
def test_mistral_sliding_window_logits_match_transformers(mistral_dir, attention):
    converted = assert_parity(mistral_dir, TOKENS, attention, shared=True)  # 16 tokens, window 6
    assert (converted.config.mask.name, converted.config.mask.window) == ("sliding_window", 6)


# Greedy generation -----------------------------------------------------------------------------


def hf_greedy(directory, prompt, n):
    model = hf_model(directory)
    with torch.no_grad():
        ids = torch.as_tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gpt2", "gqa_llama3_untied", "gqa_llama3_tied", "mistral"])
def test_greedy_generation_matches_transformers(gpt2_dir, llama_dirs, mistral_dir, which):
    directory = {"gpt2": gpt2_dir, "mistral": mistral_dir}.get(which) or llama_dirs[which]
    converted = load_hf(directory)
    prompt, n = [5, 17, 42, 7, 99], 12
    ours = generate(build_model(converted.config), converted.params, [prompt],
                    SamplingConfig(max_new_tokens=n, temperature=0.0))[0]
    assert ours == hf_greedy(directory, prompt, n)


# Export and round trips ------------------------------------------------------------------------


def assert_same_tensors(dir_a, dir_b):
    a = read_safetensors(os.path.join(dir_a, "model.safetensors"))
    b = read_safetensors(os.path.join(dir_b, "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert np.array_equal(np.asarray(a[name]).view(np.uint8),
                              np.asarray(b[name]).view(np.uint8)), name


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gpt2", "gqa_llama3_tied", "biases_head_dim", "yarn",
                                   "dynamic", "mistral"])
def test_round_trip_gives_identical_tensors_that_transformers_loads(gpt2_dir, llama_dirs,
                                                                     mistral_dir, tmp_path,
                                                                     which):
    source = {"gpt2": gpt2_dir, "mistral": mistral_dir}.get(which) or llama_dirs[which]
    converted = load_hf(source)
    out = save_hf(str(tmp_path / "out"), converted.config, converted.params,
                  base_config=converted.hf_config)
    assert_same_tensors(source, out)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        again = model.eval()(torch.as_tensor(TOKENS)).logits.numpy()
    np.testing.assert_array_equal(again, memoised_reference_logits(source, TOKENS))


@pytest.mark.slow
def test_bfloat16_round_trip_is_bit_exact(tmp_path):
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    source = save_model(model, tmp_path / "bf16")
    auto = load_hf(source, dtype="auto")
    assert auto.config.param_dtype == "bfloat16" and auto.source_dtype == "bfloat16"
    assert_same_tensors(source, save_hf(str(tmp_path / "a"), auto.config, auto.params,
                                        base_config=auto.hf_config))
    wide = load_hf(source)  # float32 params: exact, so writing bfloat16 again is too
    assert wide.config.param_dtype == "float32"
    assert_same_tensors(source, save_hf(str(tmp_path / "b"), wide.config, wide.params,
                                        base_config=wide.hf_config, dtype="bfloat16"))


@pytest.mark.slow
def test_export_of_a_model_trained_here(tmp_path):
    """A native Llama-style config exports with no base config; GPT-2 needs learned positions."""
    import flax.linen as nn
    import jax

    cfg = ModelConfig(vocab_size=101, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      norm="rmsnorm", mlp="swiglu", use_bias=False, tie_embeddings=False,
                      init_std=0.2)
    model = build_model(cfg)
    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.asarray(TOKENS))["params"])
    out = save_hf(str(tmp_path / "llama"), cfg, params)
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [
        "LlamaForCausalLM"]
    ours = np.asarray(model.apply({"params": params}, jnp.asarray(TOKENS)))
    assert np.max(np.abs(ours - reference_logits(out, TOKENS))) < ATOL

    with pytest.raises(ConversionError) as err:
        save_hf(str(tmp_path / "none"), ModelConfig(), params)
    message = str(err.value)
    assert "gpt2: position='rope'" in message.replace("to Hugging Face ", "")
    assert "norm='layernorm'" in message


# Run directories -------------------------------------------------------------------------------


@pytest.mark.slow
def test_converted_run_restores_with_load_run_and_samples(tmp_path, capsys):
    source = make_gpt2(tmp_path / "hf", vocab_size=262)  # the byte tokenizer's vocabulary
    run = str(tmp_path / "run")
    summary = convert_hf_directory(source, run)
    assert summary["tokenizer"] == "byte"
    model, params, tokenizer, config = load_run(run)
    assert tokenizer.name == "byte" and config.position.name == "learned"
    tokens = np.random.default_rng(1).integers(0, 262, (2, 16))
    logits = np.asarray(model.apply({"params": params}, jnp.asarray(tokens)))
    assert np.max(np.abs(logits - reference_logits(source, tokens))) < ATOL

    meta = json.load(open(os.path.join(run, "checkpoints", "0", "meta", "metadata")))
    assert meta["step"] == 0 and meta["source"]["architecture"] == "GPT2LMHeadModel"
    assert meta["source"]["config"]["n_embd"] == 64

    from transformers_jax.cli import main as tjax

    assert tjax(["sample", "--run", run, "--prompt", "ab", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("ab")

    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        convert_hf_directory(source, run)
    convert_hf_directory(source, run, overwrite=True)


@pytest.mark.slow
def test_fine_tuning_resumes_from_a_converted_run(tmp_path):
    from transformers_jax.config import TrainConfig
    from transformers_jax.runs.meta import read_run_meta
    from transformers_jax.train.loop import train

    source = make_gpt2(tmp_path / "hf", vocab_size=262)
    run = str(tmp_path / "run")
    convert_hf_directory(source, run)
    config = ModelConfig.from_dict(read_run_meta(run)["model"])
    out = train(config, TrainConfig(run_dir=run, steps=2, batch_size=2, seq_len=32,
                                    eval_batches=1, log_every=1, progress=False))
    assert out["steps"] == 2 and np.isfinite(out["train_loss"])


@pytest.mark.slow
def test_run_without_tokenizer_is_external_and_exports_back(llama_dirs, tmp_path):
    source = llama_dirs["gqa_llama3_untied"]
    run = str(tmp_path / "run")
    summary = convert_hf_directory(source, run)
    assert summary["tokenizer"] == "external" and "token ids" in summary["tokenizer_note"]
    model, params, tokenizer, config = load_converted_run(run)
    assert tokenizer is None and config.position.scaling.name == "llama3"
    out = export_run(run, str(tmp_path / "hf"))
    assert_same_tensors(source, out)
    exported = json.load(open(os.path.join(out, "config.json")))
    original = json.load(open(os.path.join(source, "config.json")))
    for key in ("rope_parameters", "num_key_value_heads", "rms_norm_eps", "initializer_range"):
        assert exported[key] == original[key], key


def tiny_bpe_tokenizer(directory):
    """A 300-id byte-level BPE trained on a few sentences, saved the transformers way."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran to the park"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok,
                                                eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return fast


@pytest.mark.slow
def test_hugging_face_tokenizer_travels_with_the_run(tmp_path):
    source = make_gpt2(tmp_path / "hf", vocab_size=320)
    hf_tok = tiny_bpe_tokenizer(source)
    run = str(tmp_path / "run")
    assert convert_hf_directory(source, run)["tokenizer"] == "huggingface"
    _, _, tokenizer, _ = load_converted_run(run)
    assert isinstance(tokenizer, HFTokenizer)
    ids = tokenizer.encode("the cat ran")
    assert ids.tolist() == hf_tok.encode("the cat ran") and tokenizer.decode(ids) == "the cat ran"
    assert tokenizer.eos_id == tokenizer.pad_id == hf_tok.eos_token_id
    out = export_run(run, str(tmp_path / "back"))
    again = transformers.AutoTokenizer.from_pretrained(out)
    assert again.encode("the cat ran") == ids.tolist()


@pytest.mark.slow
def test_cli_main_converts_verifies_and_exports(gpt2_dir, tmp_path, capsys):
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    assert main(["--from-hf", gpt2_dir, "--out", run, "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "converted GPT2LMHeadModel" in printed and "tokenizer: external" in printed
    diff = float(printed.split("transformers = ")[1].split()[0])
    assert diff < ATOL
    assert main(["--to-hf", out, "--run", run]) == 0
    assert_same_tensors(gpt2_dir, out)


# Checkpoint layouts ----------------------------------------------------------------------------


@pytest.mark.slow
def test_sharded_safetensors_and_pytorch_bin(gpt2_dir, tmp_path):
    model = hf_model(gpt2_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    (bin_dir / "config.json").write_text((tmp_path / "sharded" / "config.json").read_text())
    want = load_hf(gpt2_dir).params
    for directory in (tmp_path / "sharded", bin_dir):
        got = load_hf(str(directory)).params
        assert jax_tree_equal(got, want)


def jax_tree_equal(a, b):
    import jax

    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def test_safetensors_writer_matches_the_reference_reader(tmp_path):
    from safetensors.numpy import load_file

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(5, np.float16),
              "c": np.array([1, 2], np.int64)}
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, arrays)
    for name, value in load_file(path).items():
        np.testing.assert_array_equal(value, arrays[name])


# Errors ----------------------------------------------------------------------------------------


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    for config in ({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]},
                   {"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"]}):
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConversionError, match="supported architectures: .*GPT2LMHeadModel"
                           ".*LlamaForCausalLM"):
            load_hf(str(tmp_path))


GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_head": 2, "n_layer": 1}
LLAMA = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2,
         "num_hidden_layers": 1, "intermediate_size": 64}
BERT = {"model_type": "bert", "hidden_size": 32, "num_attention_heads": 2,
        "num_hidden_layers": 1, "intermediate_size": 64, "hidden_act": "gelu_new"}
BASES = {gpt2_convert: GPT2, llama_convert: LLAMA, bert_convert: BERT}


@pytest.mark.parametrize("convert, changes, message", [
    (gpt2_convert, {"activation_function": "quick_gelu"}, "activation_function='quick_gelu'"),
    (gpt2_convert, {"scale_attn_by_inverse_layer_idx": True},
     "scale_attn_by_inverse_layer_idx=True"),
    (gpt2_convert, {"add_cross_attention": True}, "add_cross_attention=True"),
    (llama_convert, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (llama_convert, {"attention_bias": True}, "attention_bias=True.*mlp_bias=False"),
    (llama_convert, {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     "rope_type='longrope'.*supported rope types: default, dynamic, linear, llama3, yarn"),
    (llama_convert, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                         "attention_factor": 1.5,
                                         "original_max_position_embeddings": 8}},
     "attention_factor=1.5"),
    (llama_convert, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "truncate": False,
                                         "original_max_position_embeddings": 8}},
     "truncate=False"),
    (llama_convert, {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    (bert_convert, {"is_decoder": True}, "is_decoder=True"),
    (bert_convert, {"position_embedding_type": "relative_key"},
     "position_embedding_type='relative_key'"),
    (bert_convert, {"hidden_act": "silu"}, "hidden_act='silu'"),
])
def test_inexpressible_config_fields_are_named(convert, changes, message):
    with pytest.raises(ConversionError, match=message):
        convert.config_from_hf({**BASES[convert], **changes})


def test_bert_token_types_beyond_two_need_a_config_field():
    if "type_vocab_size" in {f.name for f in dataclasses.fields(ModelConfig)}:
        assert bert_convert.config_from_hf({**BERT, "type_vocab_size": 3}).type_vocab_size == 3
    else:
        with pytest.raises(ConversionError, match="type_vocab_size=3.*no type_vocab_size field"):
            bert_convert.config_from_hf({**BERT, "type_vocab_size": 3})


def test_weights_that_do_not_fit_are_errors(gpt2_dir, tmp_path):
    tensors = dict(read_safetensors(os.path.join(gpt2_dir, "model.safetensors")))
    config = open(os.path.join(gpt2_dir, "config.json")).read()
    (tmp_path / "config.json").write_text(config)
    extra = {**tensors, "transformer.h.0.crossattention.c_attn.weight": np.zeros((2, 2),
                                                                                  np.float32)}
    write_safetensors(str(tmp_path / "model.safetensors"), extra)
    with pytest.raises(ConversionError, match="does not map: h.0.crossattention.c_attn.weight"):
        load_hf(str(tmp_path))
    missing = {k: v for k, v in tensors.items() if "ln_f" not in k}
    write_safetensors(str(tmp_path / "model.safetensors"), missing)
    with pytest.raises(ConversionError, match=r"lacks \['ln_f.weight'\]"):
        load_hf(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_hf(str(tmp_path / "nowhere"))


# BERT ------------------------------------------------------------------------------------------


def make_bert(directory, seed=0, **changes):
    torch.manual_seed(seed)
    fields = dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=96, max_position_embeddings=32, hidden_act="gelu_new",
                  initializer_range=0.2)
    config = transformers.BertConfig(**{**fields, **changes})
    return save_model(transformers.BertForMaskedLM(config).eval(), directory)


def bert_logits(directory, tokens, types):
    model = transformers.AutoModelForMaskedLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(torch.as_tensor(tokens),
                            token_type_ids=torch.as_tensor(types)).logits.numpy()


TYPES = (np.arange(16)[None, :] >= np.array([[6], [10]])).astype(np.int64)  # sentence A | B


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["reference", "xla"])
@pytest.mark.parametrize("variant", ["tied_gelu_tanh", "untied_relu"])
def test_bert_masked_lm_logits_match_transformers(tmp_path, variant, attention):
    changes = {} if variant == "tied_gelu_tanh" else dict(hidden_act="relu",
                                                          tie_word_embeddings=False)
    source = make_bert(tmp_path / "hf", **changes)
    converted = load_hf(source, attention=attention)
    cfg = converted.config
    assert (cfg.family, cfg.mask.name, cfg.norm_position.name, cfg.position.name) == (
        "bert", "bidirectional", "post", "learned")
    ours = build_model(cfg).apply({"params": converted.params}, jnp.asarray(TOKENS),
                                  token_types=jnp.asarray(TYPES))
    want = bert_logits(source, TOKENS, TYPES)
    assert want.std() > 0.1
    assert np.max(np.abs(np.asarray(ours) - want)) < ATOL

    out = save_hf(str(tmp_path / "out"), cfg, converted.params, base_config=converted.hf_config)
    if cfg.tie_embeddings:
        assert_same_tensors(source, out)
    np.testing.assert_allclose(bert_logits(out, TOKENS, TYPES), want, atol=0, rtol=0)


@pytest.mark.slow
def test_bert_exact_gelu_converts(tmp_path):
    """BERT's own ``hidden_act="gelu"`` is the exact erf GELU: our ``gelu_exact``."""
    source = make_bert(tmp_path, hidden_act="gelu")
    converted = load_hf(source)
    assert converted.config.mlp.name == "gelu_exact"
    ours = build_model(converted.config).apply({"params": converted.params},
                                               jnp.asarray(TOKENS),
                                               token_types=jnp.asarray(TYPES))
    assert np.max(np.abs(np.asarray(ours) - bert_logits(source, TOKENS, TYPES))) < ATOL


CONVERTIBLE_MLPS = [name for name, kind in MLPS.items() if kind.hf_names]


@pytest.mark.parametrize("mlp", CONVERTIBLE_MLPS)
def test_every_convertible_mlp_computes_its_hugging_face_activations(mlp):
    """The registry entry's ``hf_names`` are what conversion trusts: each must be the same
    function in transformers (``ACT2FN``) as the entry's activation."""
    from transformers.activations import ACT2FN

    kind = MLPS.get(mlp)()
    x = np.linspace(-8.0, 8.0, 321, dtype=np.float32)
    ours = np.asarray(kind.activation(jnp.asarray(x)))
    for name in kind.hf_names:
        theirs = ACT2FN[name](torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=3e-6, err_msg=name)


@pytest.mark.slow
def test_exact_gelu_by_erf_is_flax_exact_gelu_and_its_derivative():
    """``gelu_exact`` computes Phi from erf (XLA:CPU's erfc is 3x slower): the same values as
    flax's erfc form within 1e-6, and autodiff gives Phi(x) + x phi(x)."""
    from transformers_jax.nn.activations import gelu_erf

    x = jnp.linspace(-10.0, 10.0, 2001, dtype=jnp.float32)
    np.testing.assert_allclose(gelu_erf(x), flax.linen.gelu(x, approximate=False),
                               rtol=0, atol=1e-6)
    slope = jax.vmap(jax.grad(gelu_erf))(x)
    xs = np.asarray(x, np.float64)
    phi = np.exp(-xs**2 / 2) / np.sqrt(2 * np.pi)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(xs / np.sqrt(2)))
    np.testing.assert_allclose(slope, cdf + xs * phi, rtol=0, atol=2e-6)


@pytest.mark.parametrize("mlp", list(MLPS))
def test_every_mlp_round_trips_through_each_config_or_is_named(mlp):
    """Export then import gives the MLP back where the architecture has it (GPT-2 and BERT:
    non-gated; Llama: gated; T5: ACT or gated-ACT); elsewhere the export names the field."""
    kind = MLPS.get(mlp)
    for module, takes in ((gpt2_convert, (False,)), (bert_convert, (False,)),
                          (llama_convert, (True,)), (t5_convert, (False, True))):
        base = module.config_from_hf({"is_encoder_decoder": True} if module is t5_convert else {})
        config = base.replace(mlp=mlp)
        if kind.hf_names and kind.gated in takes:
            assert module.config_from_hf(module.config_to_hf(config, None)).mlp.name == mlp
        else:
            with pytest.raises(ConversionError, match=f"mlp='{mlp}'"):
                module.config_to_hf(config, None)


@pytest.mark.parametrize(("module", "field", "norm"), [
    (gpt2_convert, "layer_norm_epsilon", "layernorm"),
    (bert_convert, "layer_norm_eps", "layernorm"),
    (llama_convert, "rms_norm_eps", "rmsnorm"),
    (t5_convert, "layer_norm_epsilon", "rmsnorm")])
def test_the_norm_epsilon_converts_into_the_norm_switch_and_back(module, field, norm):
    """Each architecture's epsilon field is the ``eps`` of the norm it pins, both ways."""
    raw = {field: 3e-7, **({"is_encoder_decoder": True} if module is t5_convert else {})}
    config = module.config_from_hf(raw)
    assert (config.norm.name, config.norm.eps) == (norm, 3e-7)
    assert module.config_to_hf(config, None)[field] == 3e-7


@pytest.mark.parametrize(("module", "raw", "named"), [
    (gpt2_convert, {"activation_function": "tanh"}, "activation_function='tanh'.*gelu_new"),
    (bert_convert, {"hidden_act": "silu"}, "hidden_act='silu'.*non-gated"),
    (t5_convert, {"feed_forward_proj": "gated-relu"}, "feed_forward_proj='gated-relu'.*silu"),
    (t5_convert, {"feed_forward_proj": "gated-gelu-new"}, "expected ACT or gated-ACT"),
])
def test_an_activation_no_mlp_computes_is_named(module, raw, named):
    if module is t5_convert:
        raw = {"is_encoder_decoder": True, **raw}
    with pytest.raises(ConversionError, match=named):
        module.config_from_hf(raw)


# T5 --------------------------------------------------------------------------------------------


def make_t5(directory, seed=0, separate_head=False, **changes):
    torch.manual_seed(seed)
    fields = dict(vocab_size=101, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, relative_attention_max_distance=20,
                  decoder_start_token_id=0, eos_token_id=None, pad_token_id=0)
    config = transformers.T5Config(**{**fields, **changes})
    directory = save_model(transformers.T5ForConditionalGeneration(config).eval(), directory)
    if separate_head:  # what T5 v1.1-style checkpoints store: a head of its own
        path = os.path.join(directory, "model.safetensors")
        tensors = {k: np.array(v) for k, v in read_safetensors(path).items()}
        rng = np.random.default_rng(seed)
        tensors["lm_head.weight"] = rng.normal(0, 0.5, tensors["shared.weight"].shape).astype(
            np.float32)
        write_safetensors(path, tensors)
    return directory


ENCODER_TOKENS = np.random.default_rng(2).integers(0, 101, (2, 16))
DECODER_TOKENS = np.random.default_rng(3).integers(0, 101, (2, 10))
T5_VARIANTS = {
    "tied_relu_scaled": dict(),  # original T5: tied head, decoder output * d_model**-0.5
    "separate_head_gated_silu": dict(separate_head=True, feed_forward_proj="gated-silu",
                                     tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def t5_dirs(tmp_path_factory):
    return {name: make_t5(tmp_path_factory.mktemp(name), **changes)
            for name, changes in T5_VARIANTS.items()}


def t5_reference(directory):
    return hf_logits(directory, ENCODER_TOKENS, DECODER_TOKENS)


_T5_REFERENCE: dict = {}


def memoised_t5_reference(directory):
    """``t5_reference`` of a module fixture's directory, computed once for both attentions."""
    if directory not in _T5_REFERENCE:
        _T5_REFERENCE[directory] = t5_reference(directory)
    return _T5_REFERENCE[directory]


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["reference", "xla"])
@pytest.mark.parametrize("variant", list(T5_VARIANTS))
def test_t5_decoder_logits_match_transformers(t5_dirs, variant, attention):
    converted = load_hf(t5_dirs[variant], attention=attention)
    cfg = converted.config
    assert (cfg.family, cfg.position.name, cfg.attention_scale, cfg.norm.name) == (
        "encdec", "t5", 1.0, "rmsnorm")
    assert cfg.tie_embeddings == (variant == "tied_relu_scaled")
    ours = build_model(cfg).apply({"params": converted.params}, jnp.asarray(DECODER_TOKENS),
                                  encoder_inputs=jnp.asarray(ENCODER_TOKENS))
    want = memoised_t5_reference(t5_dirs[variant])
    assert want.std() > 0.1
    assert np.max(np.abs(np.asarray(ours) - want)) < ATOL


@pytest.mark.slow
def test_t5_greedy_decoding_matches_transformers(t5_dirs):
    from transformers_jax.models.encdec import greedy_decode

    directory = t5_dirs["separate_head_gated_silu"]
    converted = load_hf(directory)
    ours = greedy_decode(build_model(converted.config), converted.params,
                         jnp.asarray(ENCODER_TOKENS), max_len=8, bos_id=0, eos_id=-1, pad_id=0)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        want = model.eval().generate(torch.as_tensor(ENCODER_TOKENS), do_sample=False,
                                     max_new_tokens=8, min_new_tokens=8)
    np.testing.assert_array_equal(np.asarray(ours), want[:, 1:].numpy())  # drop the start id


@pytest.mark.slow
def test_t5_round_trip_and_run_directory(t5_dirs, tmp_path):
    source = t5_dirs["tied_relu_scaled"]
    run = str(tmp_path / "run")
    convert_hf_directory(source, run)
    model, params, tokenizer, config = load_converted_run(run)
    assert tokenizer is None and config.family == "encdec"
    out = export_run(run, str(tmp_path / "hf"))
    a = read_safetensors(os.path.join(source, "model.safetensors"))
    b = read_safetensors(os.path.join(out, "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:  # the folded output scale comes back to within one float32 rounding
        if name == "decoder.final_layer_norm.weight":
            np.testing.assert_allclose(b[name], a[name], rtol=2**-23, atol=0)
        else:
            assert np.array_equal(a[name], b[name]), name
    np.testing.assert_allclose(t5_reference(out), t5_reference(source), atol=1e-5)


def test_t5_inexpressible_fields_are_named():
    base = {"model_type": "t5", "d_model": 32, "d_kv": 8, "num_heads": 4, "num_layers": 2}
    if "n_decoder_layers" not in {f.name for f in dataclasses.fields(ModelConfig)}:
        with pytest.raises(ConversionError, match="num_decoder_layers=3"):
            t5_convert.config_from_hf({**base, "num_decoder_layers": 3})


def test_dynamic_ntk_by_position_does_not_export():
    """Hugging Face's dynamic NTK uses one base per forward pass: the per-position form
    (``length='position'``) has no export, and says which setting has."""
    from transformers_jax.convert.hf_files import ConversionError
    from transformers_jax.convert.rope import rope_to_hf

    position = ModelConfig(position={"name": "rope", "scaling": {
        "name": "dynamic_ntk", "factor": 2.0, "original_max_len": 8,
        "length": "position"}}).position
    with pytest.raises(ConversionError, match="llama.*length='position'.*length='sequence'"):
        rope_to_hf(position, "llama")
    import dataclasses

    by_window = dataclasses.replace(position, scaling=dataclasses.replace(position.scaling,
                                                                          length="sequence"))
    assert rope_to_hf(by_window, "llama")[0]["rope_type"] == "dynamic"
