"""The XLA flags the suite gives the processes its tests start (jaxpi.testing.xla.child_env)."""

from jaxpi.testing.xla import FAST_COMPILE, SUITE, child_env


def test_child_gets_its_device_count_and_keeps_every_other_flag():
    mine = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_enable_fast_math=false",
        "A": "1",
    }
    assert child_env(mine) == {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false", "A": "1"}
    assert child_env(mine, devices=4)["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=4 --xla_cpu_enable_fast_math=false"
    )
    assert child_env({"XLA_FLAGS": SUITE}) == {"XLA_FLAGS": FAST_COMPILE}
    assert "XLA_FLAGS" not in child_env({"XLA_FLAGS": SUITE}, fast_compile=False)
    assert child_env({"XLA_FLAGS": SUITE}, devices=2, fast_compile=False) == {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2"
    }
    assert "XLA_FLAGS" not in child_env({})
    assert mine["XLA_FLAGS"].startswith("--xla_force")  # the caller's mapping is left alone
