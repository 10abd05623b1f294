#!/usr/bin/env python3
"""HAProxy in front of attention_server replicas: its config, and a replica's drain.

    haproxy_routing.py config --replica r1=10.0.0.1:50051 --replica r2=10.0.0.2:50051 \
        --bind :8080 --admin_socket /run/haproxy/admin.sock --dir /etc/haproxy/attention
    haproxy -f /etc/haproxy/attention/haproxy.cfg
    haproxy_routing.py drain --source 10.0.0.2:50051 --target 10.0.0.1:50051 \
        --owner r2 --to r1 --admin_socket /run/haproxy/admin.sock \
        --map /etc/haproxy/attention/owners.map
    # then stop the r2 server (SIGTERM)

`config` renders haproxy.cfg.template (next to this file) for the replicas (each started with
--replica_name NAME) into DIR/haproxy.cfg and DIR/owners.map (each replica's name -> its
backend). `drain` takes replica `--owner` out of the pool new sessions go to, moves its sessions
to `--target` under their ids, each sealed on the source by its export (so the source refuses
their changes from then on, which the clients retry: attention_client.replicas.drain), then
points the owner's name at the target's backend (the runtime API's `set map`, and the map file, so a reload keeps it) before
it drops them on the source. See deploy/README.md, "Routing sessions across replicas".
"""
import argparse
import os
import socket
import sys

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "haproxy.cfg.template")


def render(replicas, *, bind, admin_socket, owner_map, template=TEMPLATE):
    """The config and the owner map for `replicas` [(name, "host:port")], as text."""
    with open(template) as f:
        config = f.read()
    pool = "\n".join(f"    server {name} {address} proto h2 check inter 1s"
                     for name, address in replicas)
    backends = "\n\n".join(f"backend {name}\n    server {name} {address} proto h2"
                           for name, address in replicas)
    fields = {"@POOL_SERVERS@": pool, "@OWNER_BACKENDS@": backends, "@OWNER_MAP@": owner_map,
              "@BIND@": bind, "@ADMIN_SOCKET@": admin_socket}
    for field, value in fields.items():
        config = config.replace(field, value)
    return config, "".join(f"{name} {name}\n" for name, _ in replicas)


def runtime(admin_socket, command):
    """One command of HAProxy's runtime API (its stats socket at level admin); its answer. An
    answer that is not empty is HAProxy's refusal (the commands used here answer nothing)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(admin_socket)
        s.sendall(command.encode() + b"\n")
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    return answer.decode().strip()


def _run(admin_socket, command):
    answer = runtime(admin_socket, command)
    if answer:
        raise RuntimeError(f"haproxy refused {command!r}: {answer}")


def point_owner(admin_socket, owner_map, owner, backend):
    """Sends the calls of owner `owner`'s sessions (a replica the config names) to backend
    `backend`: in the running HAProxy's map, and in the map file, so a reload keeps it."""
    _run(admin_socket, f"set map {owner_map} {owner} {backend}")
    with open(owner_map) as f:
        lines = [line for line in f if line.split()[:1] != [owner]]
    with open(owner_map + ".new", "w") as f:
        f.writelines(lines + [f"{owner} {backend}\n"])
    os.replace(owner_map + ".new", owner_map)


def drain(source, target, *, owner, to, admin_socket, owner_map, metadata=None):
    """Drains replica `owner` (Client `source`, called directly) into replica `to` (Client
    `target`): out of the pool, its sessions moved, its name pointed at `to`'s backend. Returns
    the moved session ids."""
    from attention_client import replicas
    _run(admin_socket, f"set server replicas/{owner} state maint")
    return replicas.drain(source, target, metadata=metadata,
                          switch=lambda: point_owner(admin_socket, owner_map, owner, to))


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    config = commands.add_parser("config", help="render haproxy.cfg and owners.map")
    config.add_argument("--replica", action="append", required=True, metavar="NAME=HOST:PORT")
    config.add_argument("--bind", required=True, help="the frontend's address, e.g. :8080")
    config.add_argument("--admin_socket", required=True)
    config.add_argument("--dir", required=True, help="where haproxy.cfg and owners.map go")
    move = commands.add_parser("drain", help="move a replica's sessions to a peer")
    move.add_argument("--source", required=True, help="the drained replica, HOST:PORT")
    move.add_argument("--target", required=True, help="the peer, HOST:PORT")
    move.add_argument("--owner", required=True, help="the drained replica's --replica_name")
    move.add_argument("--to", required=True, help="the peer's --replica_name")
    move.add_argument("--admin_socket", required=True)
    move.add_argument("--map", required=True, help="the owner map haproxy.cfg names")
    args = parser.parse_args(argv)
    if args.command == "config":
        replicas = [tuple(r.split("=", 1)) for r in args.replica]
        if any(len(r) != 2 for r in replicas):
            parser.error(f"--replica: expected NAME=HOST:PORT, got {args.replica}")
        owner_map = os.path.abspath(os.path.join(args.dir, "owners.map"))
        text, map_text = render(replicas, bind=args.bind, admin_socket=args.admin_socket,
                                owner_map=owner_map)
        with open(os.path.join(args.dir, "haproxy.cfg"), "w") as f:
            f.write(text)
        with open(owner_map, "w") as f:
            f.write(map_text)
        return 0
    from attention_client import Client
    with Client(args.source) as source, Client(args.target) as target:
        moved = drain(source, target, owner=args.owner, to=args.to,
                      admin_socket=args.admin_socket, owner_map=args.map)
    print(f"moved {len(moved)} sessions of {args.owner} to {args.to}: {' '.join(moved)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
