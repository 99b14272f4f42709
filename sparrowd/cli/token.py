"""``sparrowd token create|list|revoke``: per-node join credentials, issued by the trainer's daemon.

Run on the trainer's machine: the commands find the running trainer daemon through its data dir
(``daemon.json``) and speak to it over loopback with the shared swarm token, the same way
``sparrowd leave`` does. A credential is printed once and never stored: the trainer keeps its
claims (id, role, region, expiry) and who joined with it.
"""

from __future__ import annotations

import json
import sys
import time

from sparrowd.checkpoint import atomic_file
from sparrowd.client import http_call
from sparrowd.daemon.settings import default_data_dir
from sparrowd.errors import InputError
from sparrowd.swarm.identity import is_credential_id, parse_duration

from .checks import out_file
from .daemon import local_daemon


def register(sub) -> None:
    t = sub.add_parser("token", help="issue, list and revoke per-node join credentials (on the trainer)",
                       description="Per-node join credentials: each new box gets its own, instead of the shared "
                                   "swarm token, and each can be revoked alone. Run on the trainer's machine, "
                                   "with its daemon running.")
    tsub = t.add_subparsers(dest="token_command", metavar="ACTION", required=True)

    c = tsub.add_parser("create", help="issue a credential for one new box and print it",
                        description="Issue a join credential. Give it to one box: `sparrowd install "
                                    "--token-file FILE` (or `sparrowd run --token-file FILE`). The first node "
                                    "that joins with it owns it; it admits that node only.")
    c.add_argument("--role", choices=("rollout", "relay"), default="rollout", help="the box's role (default rollout)")
    c.add_argument("--region", metavar="NAME", help="the only region the box may join in (default: any)")
    c.add_argument("--node", metavar="ID", help="the only node id the box may take (default: any)")
    c.add_argument("--expires", metavar="DURATION", default="30d",
                   help="lifetime: 30d, 12h, 90m, 2w or never (default 30d)")
    c.add_argument("--out", metavar="FILE", help="write it to FILE (mode 0600) instead of printing it")
    c.set_defaults(func=cmd_create)

    ls = tsub.add_parser("list", help="the credentials issued, who joined with each, which are revoked")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)

    rv = tsub.add_parser("revoke", help="revoke a credential: its node leaves the swarm now",
                         description="Revoke a credential. The node that joined with it loses its lease at "
                                     "once; every member refuses it from its next renewal on (within a third "
                                     "of the lease TTL).")
    rv.add_argument("id", metavar="ID", help="the credential's id (from `sparrowd token list`)")
    rv.set_defaults(func=cmd_revoke)

    for p in (c, ls, rv):
        p.add_argument("--data-dir", metavar="DIR",
                       help=f"the trainer daemon's state folder (default {default_data_dir()})")


def _trainer(args) -> tuple[str, str]:
    """The local trainer daemon's URL and token."""
    data_dir, info, token = local_daemon(args.data_dir, ": run this on the trainer's machine, with its daemon "
                                                         "up (or give --data-dir)")
    if info.get("role") != "trainer":
        raise InputError(f"the daemon on {data_dir} is a {info.get('role')} node: only the trainer's daemon "
                         "issues credentials")
    return info["url"], token


def _when(t: float | None) -> str:
    return "never" if t is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(t)) + "Z"


def cmd_create(args) -> int:
    if args.expires != "never":
        try:
            parse_duration(args.expires)
        except ValueError:
            raise InputError(f"--expires {args.expires!r}: give a duration such as 30d, 12h, 90m, or never") from None
    out = out_file("--out", args.out) if args.out is not None else None  # before the credential is issued
    url, token = _trainer(args)
    r = http_call(f"{url}/v1/tracker/credentials", token, method="POST",
                  body={"role": args.role, "region": args.region, "node": args.node, "expires": args.expires})
    where = f"region {r['region']}" if r.get("region") else "any region"
    summary = (f"credential {r['id']}: role {r['role']}, {where}, node {r.get('node') or 'any'}, "
               f"expires {_when(r.get('expires'))}")
    if out is not None:
        with atomic_file(out, private=True) as tmp:
            tmp.write_text(r["credential"] + "\n")
        print(f"{summary}; written to {out}")
    else:
        print(r["credential"])
        print(summary, file=sys.stderr)
    return 0


def cmd_list(args) -> int:
    url, token = _trainer(args)
    creds = http_call(f"{url}/v1/tracker/credentials", token)["credentials"]
    if args.json:
        print(json.dumps(creds, indent=2))
        return 0
    if not creds:
        print("no credentials issued (nodes join with the shared swarm token)")
        return 0
    rows = [("ID", "ROLE", "REGION", "NODE", "EXPIRES", "STATE")]
    for c in creds:
        state = ("revoked" if c["revoked_at"] is not None else "expired" if c["expired"] else
                 "in swarm" if c["live"] else "unused" if c["node_id"] is None else "not in swarm")
        rows.append((c["id"], c["role"], c["region"] or "any", c["node_id"] or c["node"] or "-",
                     _when(c["expires"]), state))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
    return 0


def cmd_revoke(args) -> int:
    if not is_credential_id(args.id):
        raise InputError(f"{args.id!r} is not a credential id (`sparrowd token list` shows them)")
    url, token = _trainer(args)
    r = http_call(f"{url}/v1/tracker/credentials/{args.id}/revoke", token, method="POST")
    print(f"credential {r['id']} revoked" + (f"; node {r['node_id']} is out of the swarm" if r.get("node_id") else
                                              "; no node was using it"))
    return 0
