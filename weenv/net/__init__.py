"""Egress networking for envs: the policy grammar and nftables rendering (pure, no I/O), and the
node side (namespaces, veths, rules, resolver) in :mod:`weenv.net._egress`.

Only the pure modules are imported here, so :mod:`weenv.plan` can validate entries without
pulling in sockets, subprocesses or trio.
"""

from ._policy import EgressPolicy as EgressPolicy
from ._policy import Entry as Entry
from ._policy import PolicyError as PolicyError
from ._policy import parse_bandwidth as parse_bandwidth
from ._policy import parse_entry as parse_entry
from ._policy import parse_policy as parse_policy

__all__ = ["EgressPolicy", "Entry", "PolicyError", "parse_bandwidth", "parse_entry", "parse_policy"]
