"""Generation on the CPU through one compiled fp32 engine: ragged batches through the slot API (each row its own
prompt length, position and cache row) against each prompt alone, the eager model and transformers; seeded
sampling; stop tokens and stop strings; text in and out through a real tokenizer and chat template; `trtbuild
run`'s text flags. The engine is built once for the module (a prefill graph and decode graphs for buckets 1 and 4)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_CONFIG, make_hf_folder, write_recipe
from tests.engine_helpers import eager_greedy
from trtbuild.errors import InputError
from trtbuild.serving.generate import Detokenizer, TextSide, eos_ids
from trtbuild.recipe import load_recipe
from trtbuild.runner import open_session
from trtbuild.backends.sampling import Sampling

VOCAB = 320  # the tokenizer's 300 tokens fit
MAX_SEQ = 48
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["hello world, the quick brown fox jumps over the lazy dog", "héllo wörld, ça va?", "日本語のテキストです",
          "emoji 🙂 and 🚀 ok", "<|user|> <|assistant|> <|system|>"]


def make_tokenizer(folder: Path) -> Any:
    """A byte-level BPE (multi-byte characters split across tokens, as in Llama 3's and GPT's) with <s> and </s>,
    BOS added to encoded text; tokenizer_config.json with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gen") / "model"
    make_hf_folder(folder, dict(TINY_CONFIG, vocab_size=VOCAB, bos_token_id=0, eos_token_id=1,
                                max_position_embeddings=MAX_SEQ), seed=3)
    make_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 299]}))
    return folder


@pytest.fixture(scope="module")
def engine_setup(model_dir: Path) -> dict[str, Any]:
    root = model_dir.parent
    doc = {"name": "gen", "model": {"source": str(model_dir)}, "backend": "torch", "precision": "fp32",
           "shapes": {"max_batch_size": 4, "max_input_len": 16, "max_seq_len": MAX_SEQ, "batch_buckets": [1, 4]},
           "tactics": {"level": "none"}, "run": {"batch_size": 1, "input_len": 8, "output_len": 8}}
    return {"recipe": write_recipe(root, doc), "store": root / "store", "folder": model_dir}


@pytest.fixture(scope="module")
def session(engine_setup: dict[str, Any]) -> Any:
    with open_session(load_recipe(engine_setup["recipe"]), engine_setup["store"]) as s:
        yield s


PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42, 43, 44], list(range(60, 74)),
           [7, 3], [100, 90, 80, 70, 60, 50]]


def alone(session: Any, prompt: list[int], n: int, **kw: Any) -> list[int]:
    return session.generate([prompt], max_tokens=n, ignore_eos=True, **kw)[0].token_ids


def test_a_ragged_batch_gives_each_row_the_tokens_it_gets_alone_and_eager_and_transformers_agree(
        session: Any, engine_setup: dict[str, Any]) -> None:
    """Six prompts of 2 to 14 tokens through 4 cache rows (two wait for a row to free): each row's tokens are
    the ones it gets alone, the eager model's, and transformers' greedy generate's."""
    import transformers

    got = [c.token_ids for c in session.generate(PROMPTS, max_tokens=10, ignore_eos=True)]
    assert got == [alone(session, p, 10) for p in PROMPTS]
    assert got == [eager_greedy(engine_setup["folder"], [p], 10, MAX_SEQ)[0] for p in PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(engine_setup["folder"], torch_dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ten tokens each, as above
    for p, tokens in zip(PROMPTS, got):
        ids = torch.tensor([p])
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                          pad_token_id=0)
        assert out[0, len(p):].tolist() == tokens


def test_slot_api_rows_in_any_cache_rows_and_order_each_at_its_own_position(session: Any) -> None:
    """The engine's prefill/decode/release directly: rows 3 and 1 decoded in either order, a row left waiting
    while another decodes alone (the bucket's padding rows must not touch it), then resumed."""
    engine = session.engine
    want = [alone(session, p, 6) for p in PROMPTS[:3]]
    greedy = Sampling()
    a, b, c = PROMPTS[:3]
    out = {3: [engine.prefill(3, a, greedy)], 1: [engine.prefill(1, b, greedy)], 0: [engine.prefill(0, c, greedy)]}
    pos = {3: len(a), 1: len(b), 0: len(c)}

    def step(slots: list[int]) -> None:
        nxt = engine.decode(slots, [out[s][-1] for s in slots], [pos[s] for s in slots], [greedy] * len(slots))
        for s, t in zip(slots, nxt):
            out[s].append(t)
            pos[s] += 1

    step([1, 3])
    step([3, 1, 0])
    for _ in range(3):
        step([1])  # rows 3 and 0 wait; the bucket-1 graph, then below the bucket-4 graph with padding rows
    step([3, 0])
    step([3, 0])
    step([0, 3])
    for s in (1, 3, 0):
        engine.release(s)
    assert (out[3], out[1], out[0]) == (want[0], want[1], want[2][:5])


def test_bad_slot_api_calls_are_refused_by_name(session: Any) -> None:
    engine = session.engine
    with pytest.raises(InputError, match="slot 4"):
        engine.prefill(4, [1, 2], Sampling())
    with pytest.raises(InputError, match="max_input_len 16"):
        engine.prefill(0, list(range(17)), Sampling())
    with pytest.raises(InputError, match="distinct"):
        engine.decode([0, 0], [1, 1], [3, 3], [Sampling()] * 2)
    with pytest.raises(InputError, match="max_seq_len 48"):
        engine.decode([0], [1], [MAX_SEQ], [Sampling()])
    with pytest.raises(InputError, match="max_input_len 16"):
        session.generate([list(range(17))], max_tokens=2)


def test_seeded_sampling_repeats_whatever_runs_beside_it_and_greedy_limits_are_greedy(session: Any) -> None:
    prompt = PROMPTS[1]
    kw = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}
    first = alone(session, prompt, 12, **kw)
    assert alone(session, prompt, 12, **kw) == first
    # beside three other prompts, in another cache row and another bucket (4 rows, not 1)
    batch = session.generate([PROMPTS[0], PROMPTS[2], prompt, PROMPTS[3]], max_tokens=12, ignore_eos=True, **kw)
    assert batch[2].token_ids == first
    assert alone(session, prompt, 12, **(kw | {"seed": 99})) != first
    greedy = alone(session, prompt, 12)
    assert alone(session, prompt, 12, temperature=0.0, seed=5) == greedy
    assert alone(session, prompt, 12, temperature=1.5, top_k=1, seed=5) == greedy
    assert alone(session, prompt, 12, temperature=1.0, top_p=1e-6, seed=5) == greedy


def test_stop_token_ids_and_strings_end_a_row_and_are_not_returned(session: Any) -> None:
    text = session.text()
    prompt = "hello world"
    full = session.generate(prompt, max_tokens=12, ignore_eos=True)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    assert full.text == text.decode(full.token_ids)
    # a stop token: the row ends before it
    cut = next(i for i in range(1, 12) if full.token_ids[i] not in full.token_ids[:i])
    stopped = session.generate(prompt, max_tokens=12, ignore_eos=True, stop_token_ids=[full.token_ids[cut]])[0]
    assert stopped.token_ids == full.token_ids[:cut] and stopped.finish_reason == "stop"
    # a stop string taken from the middle of the text: the text ends where it begins
    middle = full.text[len(full.text) // 3:len(full.text) // 3 + 2]
    assert middle.strip()
    by_string = session.generate(prompt, max_tokens=12, ignore_eos=True, stop=[middle])[0]
    assert by_string.finish_reason == "stop" and by_string.text == full.text[:full.text.find(middle)]
    # the model's EOS ids (config.json's and generation_config.json's) end a row unless ignored
    assert text.eos_ids == {1, 299}
    eos = session.generate(prompt, max_tokens=12, stop_token_ids=[], ignore_eos=False)[0]
    assert eos.token_ids == [t for t in full.token_ids[:len(eos.token_ids)]]
    assert all(t not in (1, 299) for t in eos.token_ids)


def test_generate_takes_one_name_refuses_wrong_types_by_name_and_returns_what_the_call_says(session: Any) -> None:
    """`max_tokens` everywhere; the old `max_new_tokens` is refused with the name to use (it selected another form with
    another return type); a wrong type is an InputError naming the argument, not a TypeError from deep inside."""
    from trtbuild.serving.generate import Completion

    with pytest.raises(InputError, match=r"max_new_tokens: not a parameter; use max_tokens .*session.greedy"):
        session.generate(["hi"], max_new_tokens=4)
    with pytest.raises(InputError, match=r"max_tokens: expected an int or None, got str '4'"):
        session.generate(["hi"], max_tokens="4")
    with pytest.raises(InputError, match=r"temperature: expected a number, got str.*seed: expected an int"):
        session.generate(["hi"], max_tokens=2, temperature="0.5", seed=1.5)
    with pytest.raises(InputError, match=r"greedy\(\): max_tokens: expected an int, got str"):
        session.greedy([[1, 2, 3]], "4")
    with pytest.raises(InputError, match=r"greedy\(\): input_ids: expected a list of token-id lists"):
        session.greedy(["hi"], 4)
    done = session.generate([PROMPTS[0]], max_tokens=5, ignore_eos=True)
    assert isinstance(done, list) and all(isinstance(c, Completion) for c in done)
    ids = session.greedy([PROMPTS[0]], 5)
    assert ids == [done[0].token_ids] and session.last is not None


def test_streaming_gives_the_tokens_and_text_of_the_whole_generation(session: Any) -> None:
    full = session.generate(["hello world", "ça va"], max_tokens=9, ignore_eos=True, temperature=0.7, seed=3)
    chunks = list(session.generate(["hello world", "ça va"], max_tokens=9, ignore_eos=True, temperature=0.7, seed=3,
                                   stream=True))
    for i, done in enumerate(full):
        mine = [c for c in chunks if c.index == i]
        assert [c.token for c in mine if c.token is not None] == done.token_ids
        # (a random model's bytes need not be valid UTF-8: the detokenizer's own test has real text)
        assert "".join(c.text for c in mine) == done.text and mine[-1].finish_reason == "length"


def test_a_chat_is_rendered_by_the_models_template_as_transformers_renders_it(session: Any,
                                                                              engine_setup: dict[str, Any]) -> None:
    import transformers

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 🙂"}]
    hf = transformers.AutoTokenizer.from_pretrained(engine_setup["folder"])
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert session.text().chat(messages) == list(want)
    short = [{"role": "user", "content": "hi"}]  # within the engine's max_input_len
    reply = session.generate(short, max_tokens=5, ignore_eos=True)[0]
    assert reply.token_ids == alone(session, session.text().chat(short), 5)


def test_the_detokenizer_never_emits_half_a_character_and_holds_back_stop_prefixes(model_dir: Path) -> None:
    text_side = TextSide.from_folder(model_dir)
    text = "héllo 日本語 🙂 world, ça va?"
    ids = text_side.tokenizer.encode(text, add_special_tokens=False).ids
    assert any("\ufffd" in text_side.tokenizer.decode([i]) for i in ids)  # the test needs split characters
    watch = text_side.watch([])
    pieces = [watch.feed(i)[0] for i in ids]
    assert "".join(pieces) + watch.flush() == text and not any("\ufffd" in p for p in pieces)
    watch = text_side.watch(["語 🙂"])
    out = ""
    for i in ids:
        piece, stopped = watch.feed(i)
        out += piece
        if stopped:
            break
    assert stopped and out == "héllo 日本"
    # a stop string's prefix held back, then released when the string does not complete
    watch = text_side.watch(["world!"])
    out = "".join(watch.feed(i)[0] for i in ids)
    assert not out.endswith("world") and out + watch.flush() == text


def test_eos_ids_come_from_config_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert eos_ids(tmp_path) == {2, 7, 9}
    assert eos_ids(None, {"eos_token_id": [3]}) == {3}


def test_run_generates_text_with_the_sampling_flags(engine_setup: dict[str, Any]) -> None:
    from click.testing import CliRunner

    from trtbuild.cli import main

    args = ["run", str(engine_setup["recipe"]), "--engines", str(engine_setup["store"]), "--prompt", "hello world",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "11", "--output-len", "6", "--json"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    doc = json.loads(first.output.strip().splitlines()[-1])
    again = json.loads(CliRunner().invoke(main, args).output.strip().splitlines()[-1])
    assert doc["completions"] == again["completions"] and doc["sampling"]["seed"] == 11
    assert 1 <= len(doc["completions"][0]["token_ids"]) <= 6
    chat = CliRunner().invoke(main, ["run", str(engine_setup["recipe"]), "--engines", str(engine_setup["store"]),
                                     "--chat", "hi", "--output-len", "3", "--quiet"])
    assert chat.exit_code == 0, chat.output
    bad = CliRunner().invoke(main, ["run", str(engine_setup["recipe"]), "--engines", str(engine_setup["store"]),
                                    "--prompt", "hi", "--top-p", "1.5"])
    assert bad.exit_code == 2 and "top_p: must be in (0, 1]" in bad.output and "Traceback" not in bad.output
