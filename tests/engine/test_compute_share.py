"""The engines' turns on the cores (engine/compute_share.py): a background step never runs beside a foreground
one, steps aside between layers for a waiting foreground step, is not starved by back-to-back foreground steps,
and takes a token cap sized from its uncapped rate. Driven by threads and events, never by timings."""

from __future__ import annotations

import threading

import pytest
import torch

from conveyor.engine.compute_share import MIN_BACKGROUND_TOKENS, ComputeShare, install_yield_points, model_layers

WAIT = 30  # seconds: only a hang runs into it


def _until(predicate) -> None:
    event = threading.Event()
    for _ in range(WAIT * 1000):
        if predicate():
            return
        event.wait(0.001)
    raise AssertionError("condition never held")


def _foreground_step(share: ComputeShare, log: list[str], name: str, entered: threading.Event,
                     release: threading.Event) -> threading.Thread:
    def run() -> None:
        with share.foreground():
            log.append(f"{name} in")
            entered.set()
            assert release.wait(WAIT)
            log.append(f"{name} out")

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_background_step_waits_for_the_foreground_step_in_progress():
    share, log = ComputeShare(), []
    fg_in, fg_release, bg_in = threading.Event(), threading.Event(), threading.Event()
    fg = _foreground_step(share, log, "fg", fg_in, fg_release)
    assert fg_in.wait(WAIT)

    def background() -> None:
        with share.background():
            log.append("bg in")
            bg_in.set()

    bg = threading.Thread(target=background)
    bg.start()
    _until(lambda: share._background_waiting == 1)
    assert not bg_in.is_set()
    fg_release.set()
    fg.join(WAIT), bg.join(WAIT)
    assert log == ["fg in", "fg out", "bg in"]


def test_background_steps_aside_between_layers_for_a_waiting_foreground_step():
    share, log = ComputeShare(), []
    bg_in, bg_go, fg_in, fg_release = (threading.Event() for _ in range(4))

    def background() -> None:
        with share.background():
            log.append("bg layer 1")
            bg_in.set()
            assert bg_go.wait(WAIT)
            share.yield_point()  # no foreground step measured yet: a slice of 0, so it steps aside at once
            log.append("bg layer 2")

    bg = threading.Thread(target=background)
    bg.start()
    assert bg_in.wait(WAIT)
    fg = _foreground_step(share, log, "fg", fg_in, fg_release)
    _until(lambda: share._foreground_waiting == 1)
    assert not fg_in.is_set()  # the background holds the cores until its next layer
    bg_go.set()
    assert fg_in.wait(WAIT)
    _until(lambda: share._background_waiting == 1)
    assert log == ["bg layer 1", "fg in"]  # layer 2 waits for the foreground step
    fg_release.set()
    fg.join(WAIT), bg.join(WAIT)
    assert log == ["bg layer 1", "fg in", "fg out", "bg layer 2"]
    assert share.stats.background_yields == 1 and share.stats.background_slices == 2


def test_a_yield_point_is_a_no_op_without_a_waiting_foreground_step_or_off_the_background_thread():
    share = ComputeShare()
    share.yield_point()  # not a background thread
    with share.background():
        share.yield_point()  # nobody waits
    assert share.stats.background_yields == 0 and share.stats.background_slices == 1


def test_back_to_back_foreground_steps_let_a_waiting_background_step_in_between():
    share, log = ComputeShare(), []
    fg1_in, fg1_release, fg2_in, fg2_release = (threading.Event() for _ in range(4))
    fg1 = _foreground_step(share, log, "fg1", fg1_in, fg1_release)
    assert fg1_in.wait(WAIT)
    bg_in, bg_release = threading.Event(), threading.Event()

    def background() -> None:
        with share.background():
            log.append("bg in")
            bg_in.set()
            assert bg_release.wait(WAIT)
            log.append("bg out")

    bg = threading.Thread(target=background)
    bg.start()
    _until(lambda: share._background_waiting == 1)
    fg1_release.set()
    fg1.join(WAIT)
    assert bg_in.wait(WAIT)
    fg2 = _foreground_step(share, log, "fg2", fg2_in, fg2_release)  # the engine's next step: after the slice
    _until(lambda: share._foreground_waiting == 1)
    bg_release.set()
    assert fg2_in.wait(WAIT)
    fg2_release.set()
    fg2.join(WAIT), bg.join(WAIT)
    assert log == ["fg1 in", "fg1 out", "bg in", "bg out", "fg2 in", "fg2 out"]


def test_foreground_steps_run_together():
    share, log = ComputeShare(), []
    a_in, a_release, b_in, b_release = (threading.Event() for _ in range(4))
    a = _foreground_step(share, log, "a", a_in, a_release)
    b = _foreground_step(share, log, "b", b_in, b_release)
    assert a_in.wait(WAIT) and b_in.wait(WAIT)  # both inside at once
    a_release.set(), b_release.set()
    a.join(WAIT), b.join(WAIT)


def test_the_token_cap_fits_one_layer_in_a_slice_while_a_foreground_engine_is_busy():
    share = ComputeShare(background_share=1 / 3)
    engine = object()
    with share.background(layers=4) as turn:
        assert turn.token_cap is None  # no foreground engine: no cap
        turn.tokens = 100
    assert share._background_token_layer_s > 0
    share._foreground_step_s, share._background_token_layer_s = 0.030, 1e-4  # (measured values, set for the test)
    assert share.slice_seconds() == pytest.approx(0.015)
    assert share.token_cap() is None
    share.set_foreground_active(engine, True)
    assert share.token_cap() == 150
    with share.background(layers=4) as turn:
        assert turn.token_cap == 150
        turn.tokens = 150
    assert share._background_token_layer_s == 1e-4  # a capped step's rate is not taken
    share._background_token_layer_s = 1.0
    assert share.token_cap() == MIN_BACKGROUND_TOKENS
    share.set_foreground_active(engine, False)
    assert share.token_cap() is None


@pytest.mark.parametrize("share", [0.0, 1.0, 1.5])
def test_a_share_outside_0_to_1_is_refused(share):
    with pytest.raises(ValueError, match="between 0 and 1"):
        ComputeShare(share)


def test_yield_points_go_before_every_layer_of_a_model():
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
            self.head = torch.nn.Linear(4, 4)

        def forward(self, x):
            for layer in self.model.layers:
                x = layer(x)
            return self.head(x)

    class Counting(ComputeShare):
        calls = 0

        def yield_point(self) -> None:
            Counting.calls += 1

    model = Tiny()
    assert len(model_layers(model)) == 3
    assert install_yield_points(model, Counting()) == 3
    model(torch.zeros(1, 4))
    assert Counting.calls == 3


def test_busy_foreground_engines_split_the_threads_between_them():
    share, engines = ComputeShare(), [object(), object(), object()]
    assert share.foreground_threads(2) == 2  # (none marked active yet: all of them)
    share.set_foreground_active(engines[0], True)
    assert share.foreground_threads(2) == 2
    share.set_foreground_active(engines[1], True)
    assert share.foreground_threads(2) == 1 and share.foreground_threads(8) == 4
    share.set_foreground_active(engines[2], True)
    assert share.foreground_threads(2) == 1  # never below one
    share.set_foreground_active(engines[1], False), share.set_foreground_active(engines[2], False)
    assert share.foreground_threads(2) == 2


def test_a_step_on_one_thread_gives_the_bits_of_a_step_on_two(tiny_checkpoint):
    """Foreground engines step on fewer threads while another one is busy: a request's tokens and logprobs
    must not depend on that (the kernels' loops and torch's ops are thread-count invariant here)."""
    from conveyor.engine.llm import LLM
    from conveyor.engine.sampling_params import SamplingParams

    prompts = [[1, 2, 3, 4, 5], [7] * 20, list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            llm = LLM(checkpoint=tiny_checkpoint, parallel=4)
            results.append([(r.token_ids, r.logprobs) for r in llm.generate(prompts, params)])
    finally:
        torch.set_num_threads(threads)
    assert results[0] == results[1]
