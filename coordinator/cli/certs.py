"""``coordinator certs``: the job's PKI from the command line.

::

    coordinator certs init --out pki --job NAME         # the job CA (pki/ca-key.pem: keep safe)
    coordinator certs server --host coord.example.org --host 10.0.0.5   # -> pki/coordinator
    coordinator certs issue --site site-a               # -> pki/sites/site-a
    coordinator certs operator --name alice             # -> pki/operators/alice
    coordinator certs revoke --site site-a              # rewrites pki/crl.pem
    coordinator certs shard-key --out pki/shard.key      # the key of coordinator shards' receipts
"""

from __future__ import annotations

import argparse
from pathlib import Path

from wire.identity import check_party_name, init_ca, issue, revoke


def add_certs_parser(sub) -> None:
    certs = sub.add_parser("certs", help="create the job CA and certificates, revoke them")
    csub = certs.add_subparsers(dest="certs_command", required=True, metavar="ACTION")
    init = csub.add_parser("init", help="create the job CA")
    init.add_argument("--out", required=True, metavar="DIR", help="folder for the CA")
    init.add_argument("--job", default="isthmus", help="job name for the CA's common name")
    init.add_argument("--days", type=int, default=3650)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--ca", default="pki", metavar="DIR", help="the CA folder (default pki)")
        p.add_argument("--out", metavar="DIR", help="bundle folder (default under the CA folder)")
        p.add_argument("--days", type=float, default=365)

    site = csub.add_parser("issue", help="a site's bundle")
    site.add_argument("--site", required=True)
    common(site)
    server = csub.add_parser("server", help="the coordinator's own bundle")
    server.add_argument(
        "--host",
        action="append",
        required=True,
        metavar="NAME_OR_IP",
        help="a name or address sites dial (repeat for several)",
    )
    server.add_argument("--name", default="coordinator")
    common(server)
    op = csub.add_parser("operator", help="an operator's bundle (for `coordinator status`)")
    op.add_argument("--name", required=True)
    common(op)
    rv = csub.add_parser("revoke", help="revoke a site's or operator's certificates")
    who = rv.add_mutually_exclusive_group(required=True)
    who.add_argument("--site")
    who.add_argument("--operator")
    rv.add_argument("--ca", default="pki", metavar="DIR")
    key = csub.add_parser(
        "shard-key",
        help="the key coordinator shards sign their receipts with ([shards] on several hosts: "
        "copy it to the lead's state_dir/shard.key and to each shard host)",
    )
    key.add_argument("--out", default="pki/shard.key", metavar="FILE", help="(mode 0600)")


def run_certs(args: argparse.Namespace) -> int:
    action = args.certs_command
    if action == "init":
        folder = init_ca(args.out, args.job, args.days)
        print(f"job CA created in {folder} (keep {folder}/ca-key.pem private)")
        return 0
    if action == "shard-key":
        from coordinator.shards.receipts import create_key

        existed = Path(args.out).exists()
        create_key(Path(args.out))
        print(f"shard key {'kept' if existed else 'written'} at {args.out} (mode 0600)")
        return 0
    if action == "revoke":
        role, name = ("site", args.site) if args.site else ("operator", args.operator)
        serials = revoke(args.ca, role, name)
        print(
            f"revoked {len(serials)} certificate(s) of {role} {name!r}; "
            f"a running coordinator reading {Path(args.ca) / 'crl.pem'} refuses them now"
        )
        return 0
    flag, name = ("--site", args.site) if action == "issue" else ("--name", args.name)
    check_party_name(flag, name)
    role, name, hosts, default_out = {
        "issue": lambda: ("site", args.site, (), Path(args.ca) / "sites" / args.site),
        "server": lambda: (
            "coordinator",
            args.name,
            tuple(args.host),
            Path(args.ca) / "coordinator",
        ),
        "operator": lambda: ("operator", args.name, (), Path(args.ca) / "operators" / args.name),
    }[action]()
    out = issue(args.ca, role, name, args.out or default_out, hosts=hosts, days=args.days)
    print(f"{role} bundle for {name!r} written to {out} (cert.pem, key.pem [0600], ca.pem)")
    return 0
