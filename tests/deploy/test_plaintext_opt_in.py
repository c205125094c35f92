"""Plaintext is opt-in in the deployments too (issue 38): the images listen on 0.0.0.0 but set
neither TLS nor ``GRIDSERVE_INSECURE_INTERNAL``, so a role there starts only with one of them; the
chart gives every role one or the other (``tls.enabled``)."""

from __future__ import annotations

import pytest

from .test_chart import ROLE_PORTS, env_of, main_container
from .tools import DOCKER

pytestmark = pytest.mark.slow


def test_the_images_listen_on_every_address_but_accept_plaintext_only_when_told():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert "GRIDSERVE_HOST=0.0.0.0" in dockerfile
    instructions = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    assert not any("GRIDSERVE_INSECURE_INTERNAL" in line for line in instructions)
    readme = (DOCKER / "README.md").read_text()
    assert "-e GRIDSERVE_INSECURE_INTERNAL=1" in readme and "GRIDSERVE_TLS_CERT_FILE" in readme


@pytest.mark.parametrize("tls_on", [True, False])
def test_every_chart_role_has_tls_or_insecure_internal_never_both(render_chart, tls_on):
    rendered = render_chart({} if tls_on else {"tls": {"enabled": False}})
    roles = set()
    for workload in rendered.workloads():
        role = rendered.role_of(workload)
        if role not in ROLE_PORTS:
            continue
        roles.add(role)
        env = env_of(main_container(workload))
        assert env["GRIDSERVE_HOST"] == "0.0.0.0"
        assert ("GRIDSERVE_TLS_CERT_FILE" in env) is tls_on
        assert (env.get("GRIDSERVE_INSECURE_INTERNAL") == "1") is (not tls_on), (role, env)
    assert roles >= {"gateway", "engine", "worker"}
