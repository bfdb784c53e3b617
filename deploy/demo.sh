#!/usr/bin/env bash
# `make demo`: the whole system, one command.
#
# With a Docker engine (`docker info` succeeds): docker compose builds the
# images from this repository and starts PostgreSQL, RabbitMQ (with its UI), a
# MongoDB replica set, the orders service, a standalone relay, the shipping
# service and the monitoring (deploy/docker-compose.yml), detached, and waits
# until they are healthy. Then bin/demo (built here with Go) runs on the host
# in compose mode (-compose): it starts nothing, and serves the live view
# below for the compose project, reading the ports compose publishes and
# acting with `docker compose stop/start` and `docker compose exec rabbitmq
# rabbitmqctl`. For that, the orders API runs without its in-process relay
# (ORDERS_RELAY=false: the relay service is the only one, so "stop the
# relays" stops all publishing) and the services log at the debug level
# (LOG_LEVEL=debug: shipping's line per delivery feeds the page's delivered
# and duplicate counts). Without Go on the host it falls back to an attached
# `docker compose up --build`, with no live view.
#
# Without one: the same system as local processes (deploy/demo), against this
# machine's PostgreSQL and RabbitMQ (started here when they are down) and an
# embedded FerretDB. The binaries are built once into bin/ first, so signals
# reach the real processes rather than `go run`.
#
# Either way the demo serves a live view of the flow, with buttons that
# inject the guided scenario's faults, on http://127.0.0.1:8090 (-ui-addr;
# DEMO_UI_ADDR with compose), and prints its address; Ctrl-C stops
# everything (with compose: `docker compose stop`, the volumes are kept).
# Arguments go to `docker compose up` (e.g. --scale relay=2) or to bin/demo
# (e.g. -orders-addr 127.0.0.1:9080; see bin/demo -h). Environment:
#   DEMO_LOAD=1        also run the load generator (compose: --profile load)
#   DEMO_MODE=local    force the local processes even when Docker is there
#   DEMO_MODE=docker   force docker compose (fails without an engine)
#   DEMO_UI_ADDR       compose: the live view's address (default 127.0.0.1:8090)
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
	compose=(docker compose -f deploy/docker-compose.yml ${profile[@]+"${profile[@]}"})
	GO=${GO:-go}
	if ! command -v "$GO" >/dev/null 2>&1; then
		echo "demo: Docker engine found, no Go toolchain for the live view: ${compose[*]} up --build"
		exec "${compose[@]}" up --build "$@"
	fi
	echo "demo: building bin/demo (the live view, on the host)"
	mkdir -p bin
	"$GO" build -o bin/ ./deploy/demo
	export ORDERS_RELAY=false LOG_LEVEL=debug
	echo "demo: Docker engine found: ORDERS_RELAY=false LOG_LEVEL=debug ${compose[*]} up --build --detach --wait"
	"${compose[@]}" up --build --detach --wait "$@"
	exec bin/demo -compose deploy/docker-compose.yml -ui-addr "${DEMO_UI_ADDR:-127.0.0.1:8090}"
	;;
local)
	echo "demo: no Docker engine: running the services as local processes"
	bash deploy/local/ensure-services.sh
	GO=${GO:-go}
	echo "demo: building bin/orders bin/shipping bin/mongolocal bin/audit bin/loadgen bin/demo"
	mkdir -p bin
	"$GO" build -o bin/ ./services/orders ./services/shipping ./cmd/mongolocal ./cmd/audit ./deploy/loadgen ./deploy/demo
	args=(-bin bin)
	if [ "${DEMO_LOAD:-}" = 1 ]; then args+=(-load); fi
	exec bin/demo "${args[@]}" "$@"
	;;
*)
	echo "demo: DEMO_MODE=$mode: want docker or local" >&2
	exit 2
	;;
esac
