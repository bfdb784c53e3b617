#!/usr/bin/env bash
# `make demo`: the whole system, one command.
#
# With a Docker engine (`docker info` succeeds): docker compose builds the
# images from this repository and runs PostgreSQL, RabbitMQ (with its UI), a
# MongoDB replica set, the orders service, a standalone relay and the shipping
# service (deploy/docker-compose.yml).
#
# Without one: the same system as local processes (deploy/demo), against this
# machine's PostgreSQL and RabbitMQ (started here when they are down) and an
# embedded FerretDB. The binaries are built once into bin/ first, so signals
# reach the real processes rather than `go run`. The demo then serves a live
# view of the flow, with buttons that inject the guided scenario's faults, on
# http://127.0.0.1:8090 (-ui-addr), and prints its address.
#
# Either way Ctrl-C stops everything. Arguments go to `docker compose up`
# (e.g. --detach) or to bin/demo (e.g. -orders-addr 127.0.0.1:9080; see
# bin/demo -h). Environment:
#   DEMO_LOAD=1        also run the load generator (compose: --profile load)
#   DEMO_MODE=local    force the local processes even when Docker is there
#   DEMO_MODE=docker   force docker compose (fails without an engine)
#   DATABASE_URL, AMQP_URL, MONGO_URI   local mode: where the services go
#                      (default: database orders_demo, vhost /, 127.0.0.1:27017)
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${DEMO_MODE:-}
if [ -z "$mode" ]; then
	if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
		mode=docker
	else
		mode=local
	fi
fi

case "$mode" in
docker)
	profile=()
	if [ "${DEMO_LOAD:-}" = 1 ]; then profile=(--profile load); fi
	echo "demo: Docker engine found: docker compose -f deploy/docker-compose.yml ${profile[*]} up --build"
	exec docker compose -f deploy/docker-compose.yml ${profile[@]+"${profile[@]}"} up --build "$@"
	;;
local)
	echo "demo: no Docker engine: running the services as local processes"
	bash deploy/local/ensure-services.sh
	GO=${GO:-go}
	echo "demo: building bin/orders bin/shipping bin/mongolocal bin/loadgen bin/demo"
	mkdir -p bin
	"$GO" build -o bin/ ./services/orders ./services/shipping ./cmd/mongolocal ./deploy/loadgen ./deploy/demo
	args=(-bin bin)
	if [ "${DEMO_LOAD:-}" = 1 ]; then args+=(-load); fi
	exec bin/demo "${args[@]}" "$@"
	;;
*)
	echo "demo: DEMO_MODE=$mode: want docker or local" >&2
	exit 2
	;;
esac
