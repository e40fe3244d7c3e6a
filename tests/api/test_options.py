"""One definition of the generation options drives the API's checks and every command's flags;
loading can switch macspec's CPU layer kernels off."""

import argparse
import inspect

import pytest
from mlx_lm.models import llama

import macspec
from macspec.api import options
from macspec.api.options import GenerationOptions
from macspec.cli import build_parser


def test_the_api_takes_exactly_the_options():
    params = inspect.signature(macspec.stream_generate).parameters
    # (on_prefill: told as the prompt is read, not an option of the answer)
    front = ("pair", "prompt", "messages", "on_prefill")
    assert [p for p in params if p not in front] == list(options.NAMES)
    assert {n: params[n].default for n in options.NAMES} == options.DEFAULTS.to_dict()


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"temprature": 0.5}, "unknown option.*temprature"),
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"num_draft": True}, "num_draft=True"),
        ({"temperature": -1}, "temperature=-1"),
        ({"top_p": 0}, "top_p=0"),
        ({"seed": "1"}, "seed='1'"),
        ({"stop": [""]}, "stop=''"),
        ({"adaptive": "no"}, "adaptive='no'"),
        ({"top_logprobs": 21}, "top_logprobs=21"),
        ({"top_logprobs": True}, "top_logprobs=True"),
    ],
)
def test_bad_options_are_option_errors(pair, bad, match):
    with pytest.raises(macspec.OptionError, match=match):
        macspec.generate(pair, "hi", **bad)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_every_option_is_a_flag_of_generate_and_chat(command):
    sub = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices[command]
    dests = {a.dest for a in sub._actions}
    assert set(options.NAMES) - set(options.API_ONLY) <= dests
    assert options.API_ONLY == ("top_logprobs",) and "top_logprobs" not in dests
    args = sub.parse_args(["--stop", "x", "--stop", "y", "--no-speculation", "--top-k", "3"])
    assert options.from_args(args) == {"stop": ["x", "y"], "speculative": False, "top_k": 3}
    assert GenerationOptions.from_kwargs(**options.from_args(args)).stop == ("x", "y")
    drafter = next(a for a in sub._actions if a.dest == "drafter")
    assert drafter.choices == ["model", "ngram", "mtp"]


def test_kernels_can_be_switched_off(tiny_dirs, monkeypatch):
    stock = macspec.load(tiny_dirs[0], kernels=False)
    assert type(stock.target.model.layers[0].self_attn) is llama.Attention
    monkeypatch.setenv("MACSPEC_KERNELS", "0")
    assert type(macspec.load(tiny_dirs[0]).target.model.layers[0].self_attn) is llama.Attention
    monkeypatch.delenv("MACSPEC_KERNELS")
    fast = macspec.load(tiny_dirs[0])
    assert type(fast.target.model.layers[0].self_attn) is not llama.Attention
    prompt = [5, 9, 14, 3]
    want = macspec.generate(stock, prompt, max_tokens=20).tokens
    assert macspec.generate(fast, prompt, max_tokens=20).tokens == want
