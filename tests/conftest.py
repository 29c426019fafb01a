"""Fixtures shared by several test directories."""

import pytest


def pytest_configure(config):
    """The suite compiles on CPU: inductor's disk cache, one per ATen CPU capability, so that a
    run under a second kernel path never loads graphs compiled under the first
    (remoe.machine.kernels.separate_compile_cache)."""
    from remoe.machine.kernels import separate_compile_cache

    separate_compile_cache()


@pytest.fixture(scope="session")
def micro_data_cfg(tmp_path_factory):
    """A small built-in corpus + 384-token BPE, built once for the session: the data of the
    micro training runs of tests/train, tests/model and tests/reliability."""
    from remoe.data import DataConfig, prepare_data

    cache = tmp_path_factory.mktemp("micro_data")
    cfg = DataConfig(cache_dir=str(cache), max_bytes_per_domain=60_000, vocab_size=384)
    prepare_data(cfg, progress=False)
    return cfg


@pytest.fixture
def free_port():
    """``free_port()``: a free TCP port on the loopback interface (torchrun's master port)."""
    import socket

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return port
