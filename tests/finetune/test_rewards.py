"""The GRPO rule rewards: each built-in on right, wrong and malformed answers, the weighted sum of
``--verifier-function`` names, user functions by import path, the one-line usage errors, the
reward errors naming function and sample, and DAPO's overlong penalty. Expectations are worked
out by hand from the rules in :mod:`anyspeed.stages.common.rl.rewards`."""

from __future__ import annotations

import pytest

from anyspeed.errors import UsageError
from anyspeed.stages.common.rl import rewards as R

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)
GSM8K_COMMAS = "He earns 1,000 + 200 = <<1000+200=1200>>1,200 dollars.\n#### 1,200"


def one(name: str, completion: str, label: str) -> float:
    """The built-in reward ``name`` of a single sample."""
    out = R.BUILTIN[name](["a prompt"], [completion], [label])
    assert isinstance(out, list) and len(out) == 1
    return out[0]


@pytest.mark.parametrize(
    "completion, label, expected",
    [
        ("24 in May, 72 in all.\n#### 72", GSM8K_SOLUTION, 1.0),
        ("#### 72", "72", 1.0),
        ("#### 71", GSM8K_SOLUTION, 0.0),
        ("The answer is 72", GSM8K_SOLUTION, 0.0),  # no ####
        ("####72", "72", 0.0),  # verl's rule wants the space
        ("#### ", "72", 0.0),
        ("#### .", "72", 0.0),  # '.' is no answer
        ("#### 1,200", GSM8K_COMMAS, 1.0),
        ("#### 1200", GSM8K_COMMAS, 1.0),
        ("#### 1200", "1,200", 1.0),
        ("#### -3", "Below zero.\n#### -3", 1.0),
        ("#### 3", "#### -3", 0.0),
        ("#### 2.50", "2.5", 1.0),
        ("#### 72.0", "72", 1.0),
        ("#### 72.", "72", 1.0),
        ("first #### 71 then #### 72", "72", 1.0),  # the last one counts
        ("first #### 72 then #### 71", "72", 0.0),
        ("#### 72 dollars", "  72 \n", 1.0),
    ],
)
def test_gsm8k_strict(completion: str, label: str, expected: float):
    assert one("gsm8k", completion, label) == expected


@pytest.mark.parametrize(
    "completion, label, expected",
    [
        ("So she sold 72 clips.", GSM8K_SOLUTION, 1.0),
        ("3 apples and 5 pears make 8", "8", 1.0),
        ("it comes to 1,200 dollars", GSM8K_COMMAS, 1.0),
        ("the change is -7", "#### -7", 1.0),
        ("costs 3.50", "3.5", 1.0),
        ("72 or maybe 73", "72", 0.0),  # the last number counts
        ("no number at all", "72", 0.0),
        ("#### 72", "72", 1.0),
    ],
)
def test_gsm8k_flexible(completion: str, label: str, expected: float):
    assert one("gsm8k_flexible", completion, label) == expected


@pytest.mark.parametrize(
    "completion, label, expected",
    [
        (r"so $\boxed{\frac{1}{2}}$", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\dfrac{1}{2}}", "1/2", 1.0),
        (r"\boxed{\frac12}", "0.5", 1.0),
        (r"\boxed{-\tfrac{3}{4}}", "-0.75", 1.0),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"It is $\boxed{\frac{\sqrt{3}}{2}}$.", 1.0),
        (r"\boxed{ 5 }", r"The answer is \boxed{5}.", 1.0),
        (r"\boxed{5.}", "5", 1.0),
        (r"\boxed{x + 1}", "x+1", 1.0),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{3} no, \boxed{4}", "4", 1.0),  # the last box counts
        (r"\boxed{3} no, \boxed{4}", "3", 0.0),
        (r"\boxed{2}", "3", 0.0),
        (r"\boxed{0.333}", "1/3", 0.0),  # exact numbers only
        (r"\boxed{1+x}", "x+1", 0.0),  # not a symbolic checker
        (r"\boxed{\frac{1}{0}}", "1", 0.0),
        (r"\boxed{}", "", 0.0),
        ("the answer is 5", "5", 0.0),  # no box
        (r"\boxed{\frac{1}{2}", "0.5", 0.0),  # not closed: truncated
    ],
)
def test_boxed(completion: str, label: str, expected: float):
    assert one("boxed", completion, label) == expected
    assert one("base_acc", completion, label) == expected


def test_base_acc_is_boxed():
    assert R.BUILTIN["base_acc"] is R.BUILTIN["boxed"]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>6*7</think><answer>42</answer>", 1.0),
        ("  <think>\nmulti\nline\n</think>\n\n<answer>\n42\n</answer>\n", 1.0),
        ("<answer>42</answer>", 0.0),
        ("<think>6*7</think> 42", 0.0),
        ("<think>6*7</think><answer>42</answer> and more", 0.0),
        ("Sure! <think>6*7</think><answer>42</answer>", 0.0),
        ("<answer>42</answer><think>6*7</think>", 0.0),
        ("<think>6*7<answer>42</answer>", 0.0),
        ("", 0.0),
    ],
)
def test_format(completion: str, expected: float):
    assert one("format", completion, "42") == expected


@pytest.mark.parametrize(
    "completion, label, expected",
    [
        ("<think>half</think><answer>\\frac{1}{2}</answer>", "0.5", 1.0),
        ("<answer>3</answer> no: <answer>4</answer>", "4", 1.0),
        ("<answer>3</answer> no: <answer>4</answer>", "3", 0.0),
        ("<answer> \\boxed{7} </answer>", "7", 1.0),  # a box inside the tag is read
        ("<answer>12</answer>", r"so \boxed{12}", 1.0),
        ("<answer>13</answer>", "12", 0.0),
        ("the answer is 12", "12", 0.0),  # no tag
        ("<answer>12", "12", 0.0),  # not closed
    ],
)
def test_answer_tag(completion: str, label: str, expected: float):
    assert one("answer_tag", completion, label) == expected


def test_builtins_score_a_batch():
    out = R.BUILTIN["gsm8k"](["p"] * 3, ["#### 72", "#### 1", "none"], ["72", "1", "2"])
    assert out == [1.0, 1.0, 0.0]


def test_weighted_sum():
    fn = R.resolve(["gsm8k", "format"], [1.0, 0.1])
    completions = [
        "<think>6*7</think><answer>#### 42</answer>",  # right and well formed: 1 + 0.1
        "<think>6*7</think><answer>41</answer>",  # well formed only: 0.1
        "#### 42",  # right only: 1
        "no idea",  # 0
    ]
    out = fn(["p"] * 4, completions, ["#### 42"] * 4)
    assert out == pytest.approx([1.1, 0.1, 1.0, 0.0])


def test_weights_default_to_one():
    fn = R.resolve(["gsm8k", "gsm8k_flexible"], None)
    assert fn(["p"] * 2, ["#### 5", "it is 5"], ["5", "5"]) == [2.0, 1.0]


def test_user_function_by_import_path():
    fn = R.resolve(["helpers.user_rewards:exact", "format"], [2.0, 0.5])
    assert fn(["p"] * 2, [" 42 ", "43"], ["42", "42"]) == [2.0, 0.0]
    # a tuple of ints is fine, returned as floats
    assert R.resolve(["helpers.user_rewards:length"], [1.0])(["p"], ["abc"], ["x"]) == [3.0]


@pytest.mark.parametrize(
    "names, weights, words",
    [
        (["gsm9k"], None, ["'gsm9k'", "gsm8k"]),  # unknown: the built-in names are listed
        (["no_such_module_anyspeed:fn"], None, ["cannot import", "no_such_module_anyspeed"]),
        (["helpers.user_rewards:missing"], None, ["no attribute", "'missing'"]),
        (["helpers.user_rewards:NOT_CALLABLE"], None, ["not a function"]),
        (["helpers.user_rewards:"], None, ["unknown reward"]),
        (["gsm8k"], [1.0, 2.0], ["1 reward functions but 2 weights"]),
        (["gsm8k", "format"], [1.0], ["2 reward functions but 1 weights"]),
        (["gsm8k"], [float("nan")], ["nan", "not a finite number"]),
        (["gsm8k"], [float("inf")], ["inf", "not a finite number"]),
        ([], None, ["at least one"]),
    ],
)
def test_usage_errors_are_one_line(names, weights, words):
    with pytest.raises(UsageError) as info:
        R.resolve(names, weights)
    message = str(info.value)
    assert "\n" not in message and "--verifier-function" in message
    for word in words:
        assert word in message


def batch_of(name: str, completions: list[str]) -> list[float]:
    return R.resolve([f"helpers.user_rewards:{name}"], None)(
        ["p"] * len(completions), completions, ["l"] * len(completions)
    )


def test_error_names_the_sample_that_raises():
    with pytest.raises(R.RewardError) as info:
        batch_of("explodes", ["fine", "also fine", "boom here", "boom again"])
    message = str(info.value)
    assert "helpers.user_rewards:explodes" in message
    assert "sample 2 ('boom here')" in message
    assert "ValueError: cannot score this" in message and "\n" not in message
    assert isinstance(info.value.__cause__, ValueError)


def test_the_training_call_of_a_weighted_sum_names_the_sample_once():
    """GRPO scores the weighted sum through :func:`score` too: the failing function's message
    comes through as it is, not nested in the sum's with the sample named twice (issue 43,
    item 10)."""
    fn = R.resolve(["helpers.user_rewards:explodes", "format"], None)
    texts = ["fine", "boom here"]
    with pytest.raises(R.RewardError) as info:
        R.score(fn, ["p"] * 2, texts, ["l"] * 2)
    message = str(info.value)
    assert message.count("sample ") == 1 and "raised RewardError" not in message, message
    assert message.startswith("reward function helpers.user_rewards:explodes raised ValueError")


@pytest.mark.parametrize(
    "name, words",
    [
        ("strings", ["returned '1.0'", "sample 0 ('first')", "not a finite number"]),
        ("bools", ["returned True", "sample 0 ('first')"]),
        ("nan_second", ["returned nan", "sample 1 ('second')"]),
        ("one_number", ["returned a float", "not a list of 2 rewards"]),
        ("one_too_many", ["returned 3 rewards for 2 samples"]),
    ],
)
def test_error_names_the_function_and_bad_result(name: str, words: list[str]):
    with pytest.raises(R.RewardError) as info:
        batch_of(name, ["first", "second"])
    message = str(info.value)
    assert f"helpers.user_rewards:{name}" in message
    for word in words:
        assert word in message


def test_score_shows_only_60_chars_of_the_completion():
    from helpers import user_rewards

    long = "x" * 100
    with pytest.raises(R.RewardError) as info:
        R.score(user_rewards.strings, ["p"], [long], ["l"])
    message = str(info.value)
    assert "helpers.user_rewards:strings" in message  # named by its import path when not told
    assert "'" + "x" * 60 + "'" in message and "x" * 61 not in message


def test_score_accepts_ints_and_floats():
    from helpers import user_rewards

    assert R.score(user_rewards.length, ["p", "p"], ["ab", ""], ["l", "l"]) == [2.0, 0.0]


@pytest.mark.parametrize(
    "lengths, max_len, buffer, factor, expected",
    [
        # expected length 100 - 20 = 80; beyond it -(L - 80) / 20 * factor
        ([50, 80, 90, 100, 110], 100, 20, 1.0, [0.0, 0.0, -0.5, -1.0, -1.5]),
        ([81, 90], 100, 20, 0.5, [-0.025, -0.25]),
        ([0, 100, 500], 100, 0, 1.0, [0.0, 0.0, 0.0]),  # no buffer: no penalty
        ([0, 100, 500], 100, -5, 1.0, [0.0, 0.0, 0.0]),
        ([], 100, 20, 1.0, []),
    ],
)
def test_overlong_penalty(lengths, max_len, buffer, factor, expected):
    assert R.overlong_penalty(lengths, max_len, buffer, factor) == pytest.approx(expected)
