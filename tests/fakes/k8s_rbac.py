"""RBAC for the fake API server: the request's attributes, and the Role's verdict on them.

A FAKE's helper, for tests only. It follows the upstream code it stands in for:

- request attributes: k8s.io/apiserver/pkg/endpoints/request/requestinfo.go
  (`RequestInfoFactory.NewRequestInfo`): the verb comes from the HTTP method, `watch=true`
  (or `1`) turns list/get into `watch`, a DELETE without a name is `deletecollection`;
  `/api/v1/...` is API group "" and `/apis/{group}/{version}/...` is `{group}`; a path part
  after the name is the subresource (`pods/log`, `pytorchjobs/status`).
- the verdict: k8s.io/kubernetes/pkg/apis/rbac/v1/evaluation_helpers.go (`VerbMatches`,
  `APIGroupMatches`, `ResourceMatches` with `*` and `*/subresource`, `ResourceNameMatches`).
- the answer: k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go
  (`forbiddenMessage`) wrapped by apimachinery's `errors.NewForbidden`:
  `pods "x" is forbidden: User "system:serviceaccount:ns:sa" cannot get resource "pods/log"
  in API group "" in the namespace "ns"` (a collection request has no `"name"` part).

The Role is read from a manifest file (the repo's manifests/base/rbac.yaml by default) and,
as a simplification, granted in every namespace a request names: the tests use several
namespaces, while the real Role exists only in the namespace kustomize puts it in. A
cluster-scoped request (no namespace) is never granted, since a Role cannot grant one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# The identity pipeline steps run as (manifests/base: ServiceAccount kubellm-pipeline in the
# namespace kustomize sets, kubellm).
DEFAULT_USER = "system:serviceaccount:kubellm:kubellm-pipeline"
REPO_RBAC = Path(__file__).resolve().parents[2] / "manifests" / "base" / "rbac.yaml"


@dataclass(frozen=True)
class Attributes:
    """authorizer.Attributes of one resource request."""

    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str

    @property
    def combined(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


@dataclass(frozen=True)
class Denied:
    """One request the authorizer refused (as recorded in FakeK8s.forbidden)."""

    method: str
    path: str
    attributes: Attributes
    message: str


@dataclass(frozen=True)
class Rule:
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    resource_names: tuple[str, ...] = ()

    def allows(self, a: Attributes) -> bool:
        return (
            ("*" in self.verbs or a.verb in self.verbs)
            and ("*" in self.api_groups or a.group in self.api_groups)
            and self._resource_matches(a)
            and (not self.resource_names or a.name in self.resource_names)
        )

    def _resource_matches(self, a: Attributes) -> bool:
        for r in self.resources:
            if r in ("*", a.combined):
                return True
            if a.subresource and r == f"*/{a.subresource}":
                return True
        return False


class Role:
    """The rules of the Role(s) in a manifest, and the user its RoleBinding names."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        docs = [d for d in yaml.safe_load_all(self.path.read_text()) if isinstance(d, dict)]
        roles = [d for d in docs if d.get("kind") == "Role"]
        if not roles:
            raise ValueError(f"{self.path}: no Role in it")
        self.rules = [
            Rule(
                tuple(r.get("apiGroups") or ()),
                tuple(r.get("resources") or ()),
                tuple(r.get("verbs") or ()),
                tuple(r.get("resourceNames") or ()),
            )
            for role in roles
            for r in role.get("rules") or []
        ]
        self.user = DEFAULT_USER
        for binding in (d for d in docs if d.get("kind") == "RoleBinding"):
            for s in binding.get("subjects") or []:
                if s.get("kind") == "ServiceAccount":
                    self.user = f"system:serviceaccount:{s.get('namespace', 'default')}:{s['name']}"

    def allows(self, a: Attributes) -> bool:
        return bool(a.namespace) and any(rule.allows(a) for rule in self.rules)

    def forbidden_message(self, a: Attributes) -> str:
        qualified = f"{a.resource}.{a.group}" if a.group else a.resource
        what = f'{qualified} "{a.name}"' if a.name else qualified
        where = f'in the namespace "{a.namespace}"' if a.namespace else "at the cluster scope"
        return (
            f'{what} is forbidden: User "{self.user}" cannot {a.verb} resource '
            f'"{a.combined}" in API group "{a.group}" {where}'
        )


def verb_of(method: str, has_name: bool, query: dict[str, list[str]]) -> str:
    """requestinfo.go: the verb of a resource request."""
    if method == "GET" and (query.get("watch") or [""])[0].lower() in ("true", "1"):
        return "watch"
    return {
        "GET": "get" if has_name else "list",
        "HEAD": "get" if has_name else "list",
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if has_name else "deletecollection",
    }.get(method, method.lower())


def status_forbidden(a: Attributes, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "Forbidden",
        "details": {"name": a.name, "group": a.group, "kind": a.resource}
        if a.name
        else {"group": a.group, "kind": a.resource},
        "code": 403,
    }
