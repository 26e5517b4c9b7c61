import pytest

from specrag.cache import AdmissionQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_highest_cached_to_compute_ratio_goes_first() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(starvation_window_s=10.0, clock=Clock())
    queue.push("cold", cached_tokens=0, compute_tokens=1000)
    queue.push("warm", cached_tokens=900, compute_tokens=100)
    queue.push("half", cached_tokens=500, compute_tokens=500)
    queue.push("half-later", cached_tokens=50, compute_tokens=50)
    assert [queue.pop() for _ in range(4)] == ["warm", "half", "half-later", "cold"]
    with pytest.raises(IndexError):
        queue.pop()


def test_a_request_waiting_past_the_window_is_served_next() -> None:
    clock = Clock()
    queue: AdmissionQueue[str] = AdmissionQueue(starvation_window_s=5.0, clock=clock)
    queue.push("cold", 0, 1000)
    clock.now = 1.0
    for i in range(3):
        queue.push(f"warm{i}", 900, 100)
    assert queue.pop() == "warm0"
    clock.now = 6.5  # "cold" has waited 6.5 s > 5 s; the warm ones only 5.5 s but they came later
    assert queue.pop() == "cold"
    assert queue.pop() == "warm1"
    assert len(queue) == 1


def test_starved_requests_are_not_served_twice() -> None:
    clock = Clock()
    queue: AdmissionQueue[int] = AdmissionQueue(starvation_window_s=0.0, clock=clock)
    for i in range(200):
        queue.push(i, cached_tokens=i, compute_tokens=1)
    clock.now = 1.0
    popped = [queue.pop() for _ in range(200)]
    assert popped == list(range(200))  # all starved: arrival order
    assert len(queue) == 0
