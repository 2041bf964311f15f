"""LocalCluster's environment for co-located tier processes."""
from epd.launch import LocalCluster, colocated_openmp_env


def test_colocated_tiers_get_a_short_openmp_spin_by_default():
    env = colocated_openmp_env({"PATH": "/bin"})
    assert set(env) == {"GOMP_SPINCOUNT"} and 0 < int(env["GOMP_SPINCOUNT"]) < 300_000  # libgomp's default


def test_an_explicit_openmp_setting_wins(monkeypatch):
    assert colocated_openmp_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert colocated_openmp_env({"GOMP_SPINCOUNT": "INFINITY"}) == {}
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    assert LocalCluster("tiny-qwen2-vl").env["GOMP_SPINCOUNT"] == "123"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert LocalCluster("tiny-qwen2-vl", env={"GOMP_SPINCOUNT": "7"}).env["GOMP_SPINCOUNT"] == "7"
    assert "GOMP_SPINCOUNT" in LocalCluster("tiny-qwen2-vl").env


def test_a_single_process_gets_no_colocation_setting(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    alone = LocalCluster("tiny-qwen2-vl", num_encoders=0, num_prefills=0, num_decodes=0)  # epd serve --aggregated
    assert "GOMP_SPINCOUNT" not in alone.env
