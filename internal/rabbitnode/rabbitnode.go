// Package rabbitnode describes a RabbitMQ node of a test's own, run beside
// the machine's broker from the machine's RabbitMQ installation: every file
// and directory of the node is under one directory of the test's, so the
// machine's node and configuration are never touched.
package rabbitnode

import "path/filepath"

// Server is the broker's start script. With RUNNING_UNDER_SYSTEMD (in Env)
// it execs the Erlang VM, so the process started is the node itself:
// SIGKILL kills the node, SIGTERM stops it gracefully.
const Server = "/usr/lib/rabbitmq/bin/rabbitmq-server"

// Env is the environment that runs node (name@host) from dir: its HOME
// (dir/home, where the Erlang cookie goes), its configuration files
// (rabbitmq.conf, advanced.config, enabled_plugins, rabbitmq-env.conf, an
// empty one so the machine's NODENAME is not read), its data (dir/data),
// logs (dir/log) and pid file, with distribution on distPort and epmd on
// loopback.
func Env(dir, node, distPort string) []string {
	return []string{
		"HOME=" + filepath.Join(dir, "home"),
		"RABBITMQ_NODENAME=" + node,
		"RABBITMQ_DIST_PORT=" + distPort,
		"RABBITMQ_CONFIG_FILE=" + filepath.Join(dir, "rabbitmq.conf"),
		"RABBITMQ_ADVANCED_CONFIG_FILE=" + filepath.Join(dir, "advanced.config"),
		"RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(dir, "enabled_plugins"),
		"RABBITMQ_CONF_ENV_FILE=" + filepath.Join(dir, "rabbitmq-env.conf"),
		"RABBITMQ_MNESIA_BASE=" + filepath.Join(dir, "data"),
		"RABBITMQ_LOG_BASE=" + filepath.Join(dir, "log"),
		"RABBITMQ_PID_FILE=" + filepath.Join(dir, "rabbit.pid"),
		"ERL_EPMD_ADDRESS=127.0.0.1",
		"ERL_CRASH_DUMP=" + filepath.Join(dir, "erl_crash.dump"),
		"RUNNING_UNDER_SYSTEMD=true",
	}
}
