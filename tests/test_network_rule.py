"""Issue 30, item 1 (a hard rule of the machines the suite runs on): tests, scripts, benchmarks and examples send
traffic only to loopback (127.0.0.0/8, ::1) or to hosts in network namespaces the test itself makes.

Checked on the source: no literal IPv4 or IPv6 address in tests/, scripts/, benchmarks/ or examples/ other than
loopback and the wildcards 0.0.0.0 and ``::`` (listen on every interface; never a remote target), except

* in the namespace helper (`tests/cluster/netns.py`) and the files that make hosts with it, an address of the
  subnets it gives its namespaces (no namespace has a route out of them, and the bridge has no address of
  this machine's);
* in the functions and module constants of :data:`ALLOWED`, each with why no packet can leave from there.

Each allowance must still be needed, and the scan is shown catching planted addresses, so a scan that stopped
seeing would fail. Names are not addresses: a host name's lookup is not this scan's business.
"""

from __future__ import annotations

import ast
import inspect
import ipaddress
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cluster import netns

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "scripts", "benchmarks", "examples")

#: the helper that makes namespaces, and the subnets it gives them: ``Hosts(subnet=...)`` (default .11, .12, ...
#: of a /24) and ``second_interface`` (``10.99.<i>.1/24``, a veth pair that reaches nothing)
NAMESPACE_HELPERS = {"tests/cluster/netns.py"}
NAMESPACE_SUBNETS = netns.NETWORKS
USES_NAMESPACES = re.compile(
    r"^\s*(?:from cluster import netns|from cluster\.netns import|import cluster\.netns)\b", re.M
)

#: (file, function or module constant) where a literal address is allowed, and why nothing is sent to it.
ALLOWED: dict[tuple[str, str], str] = {
    # pure functions: the addresses are data, no socket is opened
    (
        "tests/cluster/test_interfaces.py",
        "IFACES",
    ): "made-up interfaces handed to choose_interface, a pure function (resolve, route and interfaces injected)",
    (
        "tests/cluster/test_interfaces.py",
        "test_the_interface_that_routes_to_the_chief_is_chosen",
    ): "choose_interface with an injected resolver and router: no socket",
    (
        "tests/cluster/test_interfaces.py",
        "test_on_the_chiefs_debian_host_the_route_to_another_worker_chooses",
    ): "choose_interface with an injected resolver and router: no socket",
    (
        "tests/cluster/test_interfaces.py",
        "test_loopback_only_across_hosts_with_a_single_other_interface_takes_it",
    ): "choose_interface with an injected resolver, router and interfaces: no socket",
    (
        "tests/cluster/test_interfaces.py",
        "test_a_route_by_an_address_of_no_listed_interface_falls_through_to_the_next_host",
    ): "choose_interface with an injected resolver and router: no socket",
    (
        "tests/cluster/test_interfaces.py",
        "test_ipv6_routes_choose_their_interface",
    ): "choose_interface with an injected resolver, router and interfaces: no socket",
    (
        "tests/faults/test_tf_config.py",
        "BASES",
    ): "TF_CONFIG strings for the parser fuzz (TFConfigClusterResolver parses; no socket, no lookup)",
    (
        "tests/faults/test_tf_config.py",
        "HOST_EDITS",
    ): "host edits for the parser fuzz: an unbracketed IPv6 address the parser must refuse",
    (
        "tests/cluster/test_resolvers.py",
        "test_malformed_tf_config_is_a_tf_config_error_naming_the_field",
    ): "TFConfigClusterResolver must refuse an unbracketed IPv6 address: it parses, no socket",
    (
        "tests/cluster/test_resolvers.py",
        "test_tf_config_accepts_cloud_keys_sparse_jobs_and_an_evaluator_outside_the_cluster",
    ): "TFConfigClusterResolver parses a link-local address with a zone: no socket",
    (
        "tests/cluster/test_torchrun.py",
        "test_a_bare_ipv6_master_addr_is_bracketed",
    ): "TorchrunClusterResolver brackets MASTER_ADDR: it formats addresses, no socket",
    # bind() only: an address this machine does not have fails with EADDRNOTAVAIL before any packet
    (
        "tests/parameter_server/test_ps_units.py",
        "test_server_refuses_to_start_without_a_token_or_on_a_foreign_address",
    ): "the server's listen on a foreign address must fail; it binds, it never connects",
    (
        "tests/parameter_server/test_bind_address.py",
        "test_an_address_not_of_this_host_is_refused_naming_bind_address",
    ): "the server's listen on a foreign address must fail; it binds, it never connects",
    # inside namespaces, outside their subnet
    (
        "tests/cluster/test_two_hosts.py",
        "_SERVICES",
    ): "Service addresses in a namespace host's /etc/hosts: the ps there listens on it and fails (bind only); "
    "the namespaces have no route to it",
}


@dataclass(frozen=True)
class Finding:
    file: str  # relative to the scanned root
    line: int
    scope: str  # the innermost function or class (dotted), the module constant assigned, or "<module>"
    address: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.scope}: {self.address}"


_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?!\w|\.\d)")
_IPV6 = re.compile(
    r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:(?:\d{1,3}\.){3}\d{1,3}|[0-9A-Fa-f]{0,4})"
    r"(?:%[\w.-]+)?(?![\w:]|\.\d)"
)


def _looks_like_ipv6(text: str, bracketed: bool) -> bool:
    """Tell an address from a slice: ``1::6`` parses as IPv6 but is ``sv[1::6]`` in a test. An address in a test
    is bracketed with a port after it (a slice is bracketed, but no port follows), has an IPv4 tail, four or more
    groups, or a group with a letter or 3+ digits (a ULA, a link-local, the documentation prefix all do)."""
    groups = [g for g in text.split("%")[0].split(":") if g]
    return bracketed or "." in text or len(groups) >= 4 or any(len(g) >= 3 or not g.isdigit() for g in groups)


def addresses_in(line: str) -> Iterator[str]:
    """Literal IP addresses on ``line`` that are neither loopback nor a wildcard (a dotted quad with an octet over
    255 is not an address)."""
    taken: list[tuple[int, int]] = []
    found: list[tuple[int, str, ipaddress.IPv4Address | ipaddress.IPv6Address]] = []
    for m in _IPV6.finditer(line):
        text = m.group(0)
        try:
            address = ipaddress.IPv6Address(text)
        except ValueError:
            continue
        bracketed = (
            line[m.start() - 1 : m.start()] == "[" and re.match(r"\]:\d", line[m.end() : m.end() + 3]) is not None
        )
        if _looks_like_ipv6(text, bracketed):
            taken.append(m.span())
            found.append((m.start(), text, address.ipv4_mapped or address))
    for m in _IPV4.finditer(line):
        if any(a <= m.start() < b for a, b in taken):
            continue
        try:
            found.append((m.start(), m.group(0), ipaddress.IPv4Address(m.group(0))))
        except ValueError:
            continue
    for _, text, address in sorted(found, key=lambda f: f[0]):
        if not (address.is_loopback or address.is_unspecified):
            yield text


def _scopes(text: str) -> list[tuple[int, int, str]]:
    """``(first line, last line, name)`` of every function and class (decorators included, dotted names) and of
    every module-level assignment to one name; innermost last among those that contain a line."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    spans: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                spans.append((first, child.end_lineno or child.lineno, name))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    for statement in tree.body:
        targets = (
            statement.targets
            if isinstance(statement, ast.Assign)
            else [statement.target]
            if isinstance(statement, ast.AnnAssign)
            else []
        )
        if len(targets) == 1 and isinstance(targets[0], ast.Name):
            spans.append((statement.lineno, statement.end_lineno or statement.lineno, targets[0].id))
    visit(tree, "")
    return spans


def scope_at(spans: list[tuple[int, int, str]], line: int) -> str:
    containing = [(last - first, name) for first, last, name in spans if first <= line <= last]
    return min(containing)[1] if containing else "<module>"


def scan_file(path: Path, root: Path = ROOT) -> list[Finding]:
    """Every literal address off this machine in ``path`` (a text file), with where it is."""
    try:
        text = path.read_text()
    except (UnicodeDecodeError, OSError):
        return []
    rel = path.relative_to(root).as_posix()
    spans = _scopes(text) if path.suffix == ".py" else []
    return [
        Finding(rel, number, scope_at(spans, number), address)
        for number, line in enumerate(text.splitlines(), 1)
        for address in addresses_in(line)
    ]


def scan(root: Path = ROOT, folders: tuple[str, ...] = SCANNED) -> tuple[list[Finding], set[str]]:
    """The findings under ``root``'s ``folders``, and the files among them that make namespace hosts."""
    findings: list[Finding] = []
    namespace_files: set[str] = set()
    for folder in folders:
        for path in sorted((root / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo"):
                continue
            found = scan_file(path, root)
            findings += found
            if found and _uses_namespaces(path, root):
                namespace_files.add(found[0].file)
    return findings, namespace_files


def _uses_namespaces(path: Path, root: Path) -> bool:
    return path.relative_to(root).as_posix() in NAMESPACE_HELPERS or bool(USES_NAMESPACES.search(path.read_text()))


def in_namespace_subnets(address: str) -> bool:
    return any(ipaddress.ip_address(address.split("%")[0]) in net for net in NAMESPACE_SUBNETS)


def violations(
    findings: list[Finding], namespace_files: set[str], allowed: dict[tuple[str, str], str] | None = None
) -> list[Finding]:
    allowed = ALLOWED if allowed is None else allowed
    return [
        f
        for f in findings
        if (f.file, f.scope) not in allowed and not (f.file in namespace_files and in_namespace_subnets(f.address))
    ]


def test_tests_scripts_benchmarks_and_examples_name_no_address_off_this_machine():
    findings, namespace_files = scan()
    bad = violations(findings, namespace_files)
    assert not bad, (
        "literal addresses outside loopback (issue 30: traffic only to loopback or to namespaces the "
        "test makes; use cluster.netns, or list a pure function in ALLOWED with why):\n" + "\n".join(map(str, bad))
    )
    assert findings  # the scan sees the namespace subnets and the allowed ones: it is looking


def test_every_allowance_is_still_needed():
    findings, _ = scan()
    used = {(f.file, f.scope) for f in findings}
    assert set(ALLOWED) <= used, sorted(set(ALLOWED) - used)


def test_the_namespace_subnets_are_the_helpers():
    """The allowed subnets are the helper's own constants, and the helper addresses its hosts from them."""
    assert ipaddress.ip_address(f"{netns.Hosts.subnet}.11") in NAMESPACE_SUBNETS[0]
    assert 'f"{SIDE_PREFIX}.{host.index}.1/24"' in inspect.getsource(netns.Hosts.start)
    assert ipaddress.ip_address(f"{netns.SIDE_PREFIX}.3.1") in NAMESPACE_SUBNETS[1]


def test_the_scan_catches_planted_addresses(tmp_path):
    # built from parts so that this file names none of them
    v4, v6, mapped = (
        ".".join(["198", "51", "100", "23"]),
        ":".join(["2001", "db8", "", "7"]),
        "::ffff:" + ".".join(["203", "0", "113", "9"]),
    )
    inside = ".".join(["192", "168", "77", "99"])  # a namespace subnet's
    (tmp_path / "tests" / "cluster").mkdir(parents=True)
    planted = tmp_path / "tests" / "test_planted.py"
    planted.write_text(f'''"""Connects to {v4}."""
import socket

CHIEF = "{v4}:2222"


def test_connects():
    socket.create_connection(("{v4}", 80))
    socket.create_connection(("127.0.0.2", 80))
    socket.socket().bind(("0.0.0.0", 0))
    print(sv[1::6], sv[::-1], "1.2.3", "999.1.1.1:80", "127.0.0.1:{{port}}", "[::1]:1", "[::]:1", "1.2.3.4.5")


class TestNested:
    def test_v6(self):
        return ["[{v6}]:2222", "{mapped}", "::ffff:127.0.0.1", "{inside}"]
''')
    script = tmp_path / "tests" / "ping.sh"
    script.write_text(f"#!/bin/sh\nping -c1 {v4}\ncurl http://127.0.0.1:8080/\n")
    in_namespaces = tmp_path / "tests" / "test_hosts_planted.py"
    in_namespaces.write_text(f'from cluster import netns\nOURS = "{inside}"\nTHEIRS = "{v4}"\n')
    allowed_file = tmp_path / "tests" / "cluster" / "test_interfaces.py"  # an ALLOWED file, but another function
    allowed_file.write_text(f'IFACES = {{"eth0": ["{v4}"]}}\n\n\ndef test_new():\n    return "{v4}"\n')

    findings, namespace_files = scan(tmp_path, ("tests",))
    flagged = sorted(map(str, violations(findings, namespace_files)))
    print("planted, flagged:\n" + "\n".join(flagged))
    assert flagged == sorted(
        [
            f"tests/test_planted.py:1 in <module>: {v4}",
            f"tests/test_planted.py:4 in CHIEF: {v4}",
            f"tests/test_planted.py:8 in test_connects: {v4}",
            f"tests/test_planted.py:16 in TestNested.test_v6: {v6}",
            f"tests/test_planted.py:16 in TestNested.test_v6: {mapped}",
            f"tests/test_planted.py:16 in TestNested.test_v6: {inside}",  # a subnet of namespaces, in a file with none
            f"tests/ping.sh:2 in <module>: {v4}",
            f"tests/test_hosts_planted.py:3 in THEIRS: {v4}",  # a namespace file, outside the subnets
            f"tests/cluster/test_interfaces.py:5 in test_new: {v4}",  # the IFACES line is allowed, test_new is not
        ]
    )
