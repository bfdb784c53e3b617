#!/usr/bin/env bash
# Starts this machine's PostgreSQL and RabbitMQ when they are down, and enables
# the RabbitMQ plugins the project uses. Safe to run any number of times.
set -euo pipefail

wait_for() { # name, seconds, command...
	local name=$1 secs=$2; shift 2
	for _ in $(seq "$secs"); do
		if "$@" >/dev/null 2>&1; then return 0; fi
		sleep 1
	done
	echo "ensure-services: $name did not come up in ${secs}s" >&2
	return 1
}

if ! pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1; then
	echo "ensure-services: starting PostgreSQL"
	pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
	wait_for PostgreSQL 60 pg_isready -h 127.0.0.1 -p 5432
fi

# The WAL relay (pkg/outbox/outboxwal) reads the outbox through logical
# replication, which needs wal_level=logical. Changing it takes one restart.
pgver=$(ls /etc/postgresql | head -n1)
if [ "$(psql -h 127.0.0.1 -U postgres -Atc 'SHOW wal_level' 2>/dev/null)" != "logical" ]; then
	echo "ensure-services: setting PostgreSQL's wal_level to logical and restarting it once (the WAL relay's tests need it)"
	psql -h 127.0.0.1 -U postgres -qc "ALTER SYSTEM SET wal_level = logical"
	pg_ctlcluster --skip-systemctl-redirect "$pgver" main restart
	wait_for PostgreSQL 60 pg_isready -h 127.0.0.1 -p 5432
fi

if ! rabbitmqctl -q await_startup --timeout 5 >/dev/null 2>&1; then
	echo "ensure-services: starting RabbitMQ"
	rabbitmq-server -detached || true
	wait_for RabbitMQ 120 rabbitmqctl -q await_startup --timeout 5
fi
# A broker app stopped by an interrupted fault-injection run comes back here.
if ! rabbitmqctl -q status >/dev/null 2>&1 || ! rabbitmq-diagnostics -q check_running >/dev/null 2>&1; then
	rabbitmqctl -q start_app || true
	wait_for RabbitMQ 60 rabbitmq-diagnostics -q check_running
fi
echo "ensure-services: PostgreSQL and RabbitMQ are up"
