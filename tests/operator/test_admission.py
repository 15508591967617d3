"""What the operator refuses to build from a valid spec: node folders it was not given."""

from __future__ import annotations

import pytest

from baton.api import SpecProblem, parse_spec
from baton.operator import admission


def host_spec(path):
    return parse_spec({"image": "baton-worker:1", "model": {"source": "hostPath", "path": path}})


def test_host_path_is_refused_by_default_naming_the_field():
    with pytest.raises(SpecProblem) as info:
        admission.check_spec(host_spec("/"), ())
    assert info.value.fields == ["spec.model.path"]
    assert "--allow-host-path" in str(info.value) and "pvc" in str(info.value)


@pytest.mark.parametrize("path", ["/", "/etc", "/var/run/docker.sock", "/models-evil", "/models/../etc",
                                  "models/x", "/srv/models2"])
def test_host_path_outside_the_allowed_prefixes_is_refused(path):
    with pytest.raises(SpecProblem, match="spec.model.path: hostPath"):
        admission.check_spec(host_spec(path), ("/models", "/srv/models/"))


@pytest.mark.parametrize("path", ["/models", "/models/llama-3", "/srv/models/a/b", "/models/./x"])
def test_host_path_under_an_allowed_prefix_is_accepted(path):
    admission.check_spec(host_spec(path), ("/models", "/srv/models/"))


def test_other_sources_need_no_permission():
    admission.check_spec(parse_spec({"image": "i", "model": {"source": "pvc", "claimName": "c", "path": "m"}}), ())
    admission.check_spec(parse_spec({"image": "i"}), ())
