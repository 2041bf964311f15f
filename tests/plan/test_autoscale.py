"""The online planner's decisions (``epd.plan.autoscale``) from tier loads, in-process: a load that
turns from text to images moves a decode worker to the encoders when the budget is spent (one more
encoder while it has room); a signal must last ``up_after`` intervals; nothing more is decided until
the launcher has carried out the last decision and the cool-down passed; an idle tier gives workers
back down to its minimum; a missed TTFT objective grows the tier where requests wait."""
from __future__ import annotations

import pytest

from epd.plan.autoscale import AutoscaleConfig, Planner, TierLoad


def _loads(desired: dict, encoder=(0, 0), prefill=(0, 0), decode=(0, 0), workers: dict | None = None) -> dict:
    """(waiting, running) per tier; workers in rotation as desired unless given."""
    workers = workers or desired
    return {tier: TierLoad(workers[tier], *load) for tier, load in
            (("encoder", encoder), ("prefill", prefill), ("decode", decode))}


def _planner(budget: int, counts=(1, 1, 2), **options) -> Planner:
    config = AutoscaleConfig(budget_workers=budget, up_after=3, down_after=5, cooldown_s=10.0, **options)
    return Planner(config, dict(zip(("encoder", "prefill", "decode"), counts)))


def test_images_after_text_move_a_decode_worker_to_the_encoders_when_the_budget_is_spent():
    planner = _planner(budget=4)
    text = dict(decode=(0, 6), prefill=(0, 1))  # text: decode busy, encoder idle
    for t in range(6):
        assert planner.observe(float(t), _loads(planner.desired, **text)) is None
    images = dict(encoder=(9, 2), prefill=(0, 1), decode=(0, 0))  # images, short answers: encoders queue up
    decisions = [planner.observe(6.0 + t, _loads(planner.desired, **images)) for t in range(3)]
    assert decisions[:2] == [None, None]  # two intervals are not enough
    decision = decisions[2]
    assert decision.desired == {"encoder": 2, "prefill": 1, "decode": 1}
    assert "encoder hot for 3 intervals (9.0 waiting per worker" in decision.reason
    assert "budget of 4 is spent: a decode worker moves to encoder" in decision.reason
    assert list(planner.log) == [decision]


def test_a_hot_tier_grows_while_the_budget_has_room_and_a_flapping_signal_decides_nothing():
    planner = _planner(budget=6)
    for t in range(10):  # hot every other interval: never 3 in a row
        assert planner.observe(float(t), _loads(planner.desired, prefill=(0 if t % 2 else 8, 1), decode=(0, 4))) is None
    for t in range(10, 13):
        decision = planner.observe(float(t), _loads(planner.desired, prefill=(8, 1), decode=(0, 4)))
    assert decision.desired == {"encoder": 1, "prefill": 2, "decode": 2}
    assert "one more prefill worker (budget 5 of 6)" in decision.reason


def test_nothing_more_until_the_launcher_carried_out_the_decision_and_the_cooldown_passed():
    planner = _planner(budget=8)
    for t in range(3):
        decision = planner.observe(float(t), _loads(planner.desired, encoder=(9, 1)))
    assert decision.desired["encoder"] == 2
    before = {"encoder": 1, "prefill": 1, "decode": 2}
    for t in range(3, 30):  # the new encoder has not joined yet: still hot, nothing decided
        assert planner.observe(float(t), _loads(planner.desired, encoder=(9, 1), workers=before)) is None
    for t in range(30, 33):  # it joined, the cool-down is long past: three more hot intervals grow it again
        decision = planner.observe(float(t), _loads(planner.desired, encoder=(9, 1)))
    assert decision.desired["encoder"] == 3
    planner.observe(33.0, _loads(planner.desired, encoder=(9, 1)))
    for t in range(34, 36):  # joined at once, but within the cool-down
        assert planner.observe(float(t), _loads(planner.desired, encoder=(9, 1))) is None


def test_an_idle_tier_gives_workers_back_down_to_its_minimum_never_below():
    planner = _planner(budget=8, counts=(1, 1, 3))
    decisions = [planner.observe(float(t), _loads(planner.desired)) for t in range(60)]
    made = [d for d in decisions if d is not None]
    assert [d.desired for d in made] == [{"encoder": 1, "prefill": 1, "decode": 2},
                                          {"encoder": 1, "prefill": 1, "decode": 1}]
    assert "decode idle for 5 intervals" in made[0].reason and made[1].at_s - made[0].at_s >= 10


def test_a_tier_busy_between_the_looks_is_not_idle_and_the_least_busy_one_gives_a_worker_up():
    """Requests counted at one instant miss work that comes and goes between two looks: a prefill
    tier with nothing waiting or running at any look, but whose engines worked 60% of the time, keeps
    its workers (at 10% it gives one back, saying so); when a hot tier needs a worker and the budget is
    spent, the idle tier whose engines worked least gives it."""
    def look(prefill_busy, decode_busy=None):
        return {"encoder": TierLoad(1, 0, 1, 0.5), "prefill": TierLoad(2, 0, 0, prefill_busy),
                "decode": TierLoad(2, 0, 0, decode_busy)}

    busy = _planner(budget=8, counts=(1, 2, 2))
    assert all(busy.observe(float(t), look(0.6, 0.9)) is None for t in range(30))
    quiet = _planner(budget=8, counts=(1, 2, 2))
    made = [d for d in (quiet.observe(float(t), look(0.1, 0.9)) for t in range(6)) if d is not None]
    assert [d.desired for d in made] == [{"encoder": 1, "prefill": 1, "decode": 2}]
    assert "prefill idle for 5 intervals (nothing waiting, 0.0 running per worker, busy 10%)" in made[0].reason
    # the encoders queue, the budget is spent: prefill (busy 20%) and decode (busy 5%) are both idle
    moving = _planner(budget=5, counts=(1, 2, 2))
    for t in range(6):
        decision = moving.observe(float(t), {"encoder": TierLoad(1, 9, 2, 1.0), "prefill": TierLoad(2, 0, 0, 0.2),
                                             "decode": TierLoad(2, 0, 0, 0.05)})
        if decision is not None:
            break
    assert decision.desired == {"encoder": 2, "prefill": 2, "decode": 1}
    assert "a decode worker moves to encoder (decode: nothing waiting, 0.0 running per worker, busy 5%)" in \
        decision.reason


def test_a_busy_share_outside_zero_to_one_is_refused():
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=f"idle_busy is a share of the time, in \\(0, 1\\]; got {bad}"):
            AutoscaleConfig(budget_workers=4, idle_busy=bad)


def test_a_missed_ttft_objective_grows_the_tier_where_requests_wait():
    planner = _planner(budget=6, ttft_slo_s=1.0)
    for t in range(5):  # met: nothing (1 waiting per worker is under the queue threshold)
        assert planner.observe(float(t), _loads(planner.desired, encoder=(1, 1), decode=(0, 4)), ttft_p90_s=0.5) is None
    decisions = [planner.observe(5.0 + t, _loads(planner.desired, encoder=(1, 1), decode=(0, 4)), ttft_p90_s=2.5)
                 for t in range(3)]
    assert decisions[:2] == [None, None]
    decision = decisions[2]
    assert decision.desired["encoder"] == 2 and "TTFT p90 2.50 s over the objective 1 s" in decision.reason


def test_a_budget_too_small_for_the_tiers_is_refused_naming_it():
    with pytest.raises(ValueError, match="budget of 2 workers cannot give each of the 3 tiers its minimum of 1"):
        AutoscaleConfig(budget_workers=2)


def test_the_routers_planner_reads_the_workers_health_and_shows_what_it_wants(caplog):
    """``PlannerLoop``: a tier's load is its workers in rotation (a draining one does not count) and
    their health's waiting and running requests; the TTFT p90 is of the last 30 s; a decision sets
    ``epd_planner_desired_workers`` and is logged with its reason."""
    from types import SimpleNamespace

    from epd.config import RouterConfig
    from epd.router.autoscale import PlannerLoop
    from epd.router.metrics import RouterMetrics
    from tests.prom import sample_sum

    def worker(waiting, running, draining=False, on_inputs=0, busy=None):
        return SimpleNamespace(healthy=True, draining=draining, stopping=False, busy_fraction=busy,
                               last_health=SimpleNamespace(num_waiting=waiting, num_running=running,
                                                           num_waiting_on_inputs=on_inputs))

    # prefill: 6 waiting, all for their rows (the encoders' pressure, not prefill's)
    workers = SimpleNamespace(workers={"encoder": [worker(7, 2, busy=0.9)], "prefill": [worker(6, 1, on_inputs=6)],
                                       "decode": [worker(0, 0, busy=0.1), worker(0, 0, busy=0.3),
                                                  worker(5, 5, draining=True, busy=1.0)]})
    config = RouterConfig(autoscale_budget=4)  # the planner's defaults
    metrics = RouterMetrics("m")
    loop = PlannerLoop(config, workers, metrics)
    loads = loop.loads()
    assert (loads["decode"].workers, loads["decode"].waiting, loads["encoder"].waiting) == (2, 0, 7)
    assert loads["prefill"].waiting == 0
    # the busy share: the mean of the workers in rotation that count it (none: not known)
    assert (loads["decode"].busy, loads["encoder"].busy, loads["prefill"].busy) == (pytest.approx(0.2), 0.9, None)
    metrics.recent_ttft.extend([(0.0, 9.0)] + [(100.0 + i, i / 10) for i in range(11)])
    assert loop.ttft_p90_s(110.0) == 0.9  # the 9 s at t=0 is out of the window
    assert loop.as_dict()["desired"] == {"encoder": 1, "prefill": 1, "decode": 3}  # as registered
    with caplog.at_level("INFO", logger="epd.router"):
        for t in range(3):
            loop.step(200.0 + t)
    assert loop.as_dict()["desired"] == {"encoder": 2, "prefill": 1, "decode": 2}
    assert loop.as_dict()["tiers"]["encoder"] == {"workers": 1, "waiting": 7, "running": 2, "busy": 0.9}
    assert "decode: nothing waiting, 0.0 running per worker, busy 20%" in loop.as_dict()["decisions"][-1]["reason"]
    text = metrics.render().decode()
    assert sample_sum(text, "epd_planner_desired_workers", tier="encoder") == 2
    assert sample_sum(text, "epd_planner_decisions_total") == 1
    assert any("planner: encoder hot for 3 intervals" in r.message for r in caplog.records)


def test_the_routers_floor_per_tier_keeps_a_tier_from_giving_up_its_workers():
    """``--autoscale-min-workers 2``: the encoders are hot and the budget is spent, but the decode
    tier is at its floor, so no worker moves; a budget that cannot keep the floor is refused."""
    from types import SimpleNamespace

    from epd.config import RouterConfig
    from epd.router.autoscale import PlannerLoop
    from epd.router.metrics import RouterMetrics

    def worker(waiting, running):
        return SimpleNamespace(healthy=True, draining=False, stopping=False, busy_fraction=None,
                               last_health=SimpleNamespace(num_waiting=waiting, num_running=running,
                                                           num_waiting_on_inputs=0))

    workers = SimpleNamespace(workers={"encoder": [worker(9, 2), worker(9, 2)], "prefill": [worker(0, 1)] * 2,
                                       "decode": [worker(0, 0), worker(0, 0)]})
    floors = {}
    for floor in (1, 2):
        loop = PlannerLoop(RouterConfig(autoscale_budget=6, autoscale_min_workers=floor), workers,
                           RouterMetrics(f"m{floor}"))
        for t in range(12):  # hot for 3 looks, idle for 10
            loop.step(200.0 + t)
        floors[floor] = loop.as_dict()["desired"]
    assert floors[1]["encoder"] == 3 and floors[1]["decode"] == 1  # without a floor of 2: a decode moves
    assert floors[2] == {"encoder": 2, "prefill": 2, "decode": 2}  # at the floor: nothing moves
    started_below = Planner(AutoscaleConfig(budget_workers=6, min_workers=2), {"encoder": 1, "prefill": 2,
                                                                                "decode": 3})
    quiet = {t: TierLoad(n, 0, 1) for t, n in started_below.desired.items()}
    decision = started_below.observe(0.0, quiet)  # the decode tier is above its floor and the budget spent
    assert decision.desired == {"encoder": 2, "prefill": 2, "decode": 2}
    assert decision.reason.startswith("encoder has 1 worker(s), under its minimum of 2")
    with pytest.raises(ValueError, match="autoscale_budget 5 cannot keep autoscale_min_workers 2 in each of the 3 "
                                         "tiers; expected at least 6"):
        RouterConfig(autoscale_budget=5, autoscale_min_workers=2)


def test_the_ray_launcher_follows_the_plan_shrinking_tiers_first(capsys):
    """``follow_planner`` (``epd serve --launcher ray --autoscale-budget``): each round it reads the
    router's plan and scales each tier that differs, the shrinking ones first (on a full cluster the
    removed actor's resources are what the new one needs); ``scale`` itself is the Ray deployment's,
    run on a real Ray in tests/deploy/test_ray.py."""
    import threading

    from epd.server.ray import follow_planner

    class FakeCluster:
        def __init__(self) -> None:
            self.actors = {"encoder": [1], "prefill": [1], "decode": [1, 2]}
            self.calls, self.rounds, self.stop = [], 0, threading.Event()

        def plan(self) -> dict:
            self.rounds += 1
            if self.rounds == 3:
                self.stop.set()
            reason = "encoder hot for 3 intervals; the budget of 4 is spent: a decode worker moves to encoder"
            return {"desired": {"encoder": 2, "prefill": 1, "decode": 1}, "decisions": [{"reason": reason}]}

        def scale(self, tier: str, replicas: int) -> None:
            self.calls.append((tier, replicas))
            self.actors[tier] = list(range(replicas))

    cluster = FakeCluster()
    follow_planner(cluster, cluster.stop, period_s=0.01)
    assert cluster.calls == [("decode", 1), ("encoder", 2)]  # once: the next rounds find it done
    assert "autoscale: decode 2 -> 1: encoder hot for 3 intervals" in capsys.readouterr().out
