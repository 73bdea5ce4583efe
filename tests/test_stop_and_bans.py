"""Stop strings, stop token ids, EOS, min_tokens, bad words and logit bias.

The reference for each case is the same prompt run without the constraint: a stop condition must
cut that output exactly where the condition first holds, and a ban must change only what it bans.
"""
import pytest

from fastdeploy import LLM, SamplingParams

PROMPT = [17, 250, 33, 480, 91, 700, 12, 5]
EOS = 2


@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, block_size=16, max_num_seqs=8)


def greedy(**kwargs):
    return SamplingParams(temperature=0, max_tokens=kwargs.pop("max_tokens", 24), ignore_eos=kwargs.pop(
        "ignore_eos", True), **kwargs)


@pytest.fixture(scope="module")
def free_run(llm):
    out = llm.generate([PROMPT], greedy(logprobs=3), use_tqdm=False)[0].outputs
    assert len(out.text) > 30  # enough text to cut
    return out


def prefix_text(llm, tokens):
    return llm.get_tokenizer().decode(tokens)


def first_token_count_containing(llm, tokens, stop):
    for k in range(1, len(tokens) + 1):
        if stop in prefix_text(llm, tokens[:k]):
            return k
    raise AssertionError("stop string never appears")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("span", [(10, 16), (3, 4), (17, 24)])
def test_stop_string_cuts_text_and_keeps_whole_tokens(llm, free_run, include, span):
    """Multi-token and mid-token stop strings, with and without include_stop_str_in_output."""
    stop = free_run.text[span[0]:span[1]]
    assert "\ufffd" not in stop  # an undecodable byte is only decided one token later
    out = llm.generate([PROMPT], greedy(stop=[stop], include_stop_str_in_output=include), use_tqdm=False)[0].outputs
    cut = free_run.text.index(stop)
    assert out.text == free_run.text[:cut + (len(stop) if include else 0)]
    k = first_token_count_containing(llm, free_run.token_ids, stop)
    assert out.token_ids == free_run.token_ids[:k]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_earliest_of_several_stop_strings_wins(llm, free_run):
    late, early = free_run.text[25:29], free_run.text[8:11]
    out = llm.generate([PROMPT], greedy(stop=[late, early, "\x00never"]), use_tqdm=False)[0].outputs
    first = min((free_run.text.index(s), s) for s in (late, early))
    assert out.text == free_run.text[:first[0]] and out.stop_reason == first[1]


def test_absent_stop_string_changes_nothing(llm, free_run):
    out = llm.generate([PROMPT], greedy(stop="\x00never"), use_tqdm=False)[0].outputs
    assert out.token_ids == free_run.token_ids and out.text == free_run.text
    assert out.finish_reason == "length" and out.stop_reason is None


def test_stop_token_ids(llm, free_run):
    stop_id = free_run.token_ids[5]
    k = free_run.token_ids.index(stop_id)
    out = llm.generate([PROMPT], greedy(stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs
    assert out.token_ids == free_run.token_ids[:k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # min_tokens masks stop ids: the stop id can no longer be chosen before min_tokens tokens.
    out = llm.generate([PROMPT], greedy(stop_token_ids=[stop_id], min_tokens=k + 2), use_tqdm=False)[0].outputs
    assert stop_id not in out.token_ids[:k + 1]


def test_eos_from_generation_config_and_min_tokens(llm):
    force_eos = {"logit_bias": {EOS: 100.0}}
    out = llm.generate([PROMPT], greedy(ignore_eos=False, min_tokens=0, logits_processors_args=force_eos),
                       use_tqdm=False)[0]
    assert out.outputs.token_ids == [EOS] and out.outputs.text == ""
    assert (out.outputs.finish_reason, out.outputs.stop_reason) == ("stop", EOS)
    # The default min_tokens=1 masks EOS for the first token only; min_tokens=3 for three.
    for min_tokens in (1, 3):
        out = llm.generate([PROMPT], greedy(ignore_eos=False, min_tokens=min_tokens, logits_processors_args=force_eos),
                           use_tqdm=False)[0].outputs
        assert len(out.token_ids) == min_tokens + 1 and out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1]
    out = llm.generate([PROMPT], greedy(ignore_eos=True, max_tokens=5, logits_processors_args=force_eos),
                       use_tqdm=False)[0].outputs
    assert out.token_ids == [EOS] * 5 and out.finish_reason == "length"


def test_logit_bias_steers_greedy_choice(llm, free_run):
    target = 321
    out = llm.generate([PROMPT], greedy(max_tokens=6, logits_processors_args={"logit_bias": {target: 100}}),
                       use_tqdm=False)[0].outputs
    assert out.token_ids == [target] * 6
    # A large negative bias on the greedy first token makes the runner-up win.
    first = free_run.token_ids[0]
    runner_up = sorted(free_run.logprobs[0].items(), key=lambda kv: kv[1].rank)[1][0]
    out = llm.generate([PROMPT], greedy(max_tokens=1, logits_processors_args={"logit_bias": {first: -100}}),
                       use_tqdm=False)[0].outputs
    assert out.token_ids == [runner_up]


def test_bad_words_token_ids(llm, free_run):
    first = free_run.token_ids[0]
    runner_up = sorted(free_run.logprobs[0].items(), key=lambda kv: kv[1].rank)[1][0]
    out = llm.generate([PROMPT], greedy(bad_words_token_ids=[first]), use_tqdm=False)[0].outputs
    assert out.token_ids[0] == runner_up and first not in out.token_ids


def word_sequences(tokenizer, token_ids, length):
    """(word, ids) for runs of `length` output tokens that are how the word itself encodes."""
    found = []
    for i in range(len(token_ids) - length + 1):
        ids = tuple(token_ids[i:i + length])
        word = tokenizer.decode(list(ids)).strip()
        spellings = {tuple(tokenizer.encode(w, add_special_tokens=False)) for w in (word, " " + word)}
        if word.isalpha() and ids in spellings:
            found.append((word, spellings))
    return found


@pytest.mark.parametrize("length", [1, 2])
def test_bad_words_ban_token_sequences(llm, free_run, length):
    candidates = word_sequences(llm.get_tokenizer(), free_run.token_ids, length)
    assert candidates, "the free run must contain a word to ban"
    word, spellings = candidates[0]
    out = llm.generate([PROMPT], greedy(bad_words=[word]), use_tqdm=False)[0].outputs
    for seq in spellings:
        n = len(seq)
        assert all(tuple(out.token_ids[i:i + n]) != seq for i in range(len(out.token_ids) - n + 1))
    assert out.token_ids != free_run.token_ids


@pytest.mark.parametrize("kwargs, name", [
    ({"logits_processors_args": {"logit_bias": {"x": 1}}}, "logit_bias"),
    ({"logits_processors_args": {"logit_bias": {3: 500}}}, "logit_bias"),
    ({"logits_processors_args": {"other": 1}}, "logits_processors_args"),
])
def test_bad_logits_processors_args(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        SamplingParams(**kwargs)
