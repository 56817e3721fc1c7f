"""The time left on a progress bar counts down while a step runs (issue 33: eval's time left
grew while a 512-token window ran, re-estimated at each refresh from the tokens done before
the window and the time spent inside it). Rich's clock is the test's own: no waiting."""

from __future__ import annotations

from rich.progress import Progress

from qtool.report import console


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _seconds(text: str) -> int:
    if text == "-:--:--":  # nothing done yet
        return -1
    h, m, s = (int(p) for p in text.split(":"))
    return h * 3600 + m * 60 + s


def test_the_time_left_never_grows_between_steps_and_is_the_average_at_each() -> None:
    """Two windows of 512 tokens of 1,024, 20 s each, refreshed every second (as eval's bar);
    a third update at a slower pace gives a larger estimate only when the count moves."""
    clock, column = Clock(), console._SteadyTimeLeft()
    with Progress(column, get_time=clock, disable=True) as progress:
        task_id = progress.add_task("tokens", total=2048)
        shown: list[tuple[float, int]] = []
        for step in range(3):
            for _ in range(20 + 20 * (step == 2)):  # the third window takes 40 s
                clock.now += 1.0
                shown.append((clock.now, _seconds(str(column.render(progress.tasks[0])))))
            progress.update(task_id, advance=512)
            shown.append((clock.now, _seconds(str(column.render(progress.tasks[0])))))
    by_time = dict(shown)
    assert by_time[20.0] == 60  # 512 of 2,048 in 20 s: 1,536 left at the same pace
    within = [left for now, left in shown if 20.0 < now < 40.0]
    assert within == sorted(within, reverse=True) and within[-1] < 60  # counts down
    assert by_time[40.0] == 40  # 1,024 in 40 s
    assert shown[-1] == (80.0, 26)  # 1,536 in 80 s: 512 left take 26.7 s
    assert shown[:20] == [(float(t), -1) for t in range(1, 21)]
