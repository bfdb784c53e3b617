package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
)

// describeMachine reads what the figures depend on: cores, memory, and the
// versions and settings of the servers. What cannot be read is left empty.
func describeMachine(ctx context.Context, databaseURL, amqpURL string) Machine {
	m := Machine{NumCPU: runtime.NumCPU(), Go: runtime.Version()}
	if f, err := os.Open("/proc/meminfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if fields := strings.Fields(sc.Text()); len(fields) >= 2 && fields[0] == "MemTotal:" {
				kb, _ := strconv.ParseInt(fields[1], 10, 64)
				m.MemoryMiB = kb / 1024
			}
		}
		_ = f.Close()
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		if f := strings.Fields(string(b)); len(f) >= 3 {
			m.LoadAvg = strings.Join(f[:3], " ")
		}
	}

	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, databaseURL); err == nil {
		_ = conn.QueryRow(ctx, "SHOW server_version").Scan(&m.PostgreSQL)
		m.PostgreSQLSettings = map[string]string{}
		rows, err := conn.Query(ctx, `SELECT name, current_setting(name) FROM pg_settings
			WHERE name IN ('autovacuum', 'fsync', 'synchronous_commit', 'shared_buffers', 'max_connections')`)
		if err == nil {
			for rows.Next() {
				var k, v string
				if rows.Scan(&k, &v) == nil {
					m.PostgreSQLSettings[k] = v
				}
			}
			rows.Close()
		}
		_ = conn.Close(ctx)
	}
	if conn, err := amqp.Dial(amqpURL); err == nil {
		if v, ok := conn.Properties["version"].(string); ok {
			m.RabbitMQ = v
		}
		_ = conn.Close()
	}
	return m
}

// parseLoad1 returns the one-minute load average from the text of
// /proc/loadavg ("0.52 0.58 0.59 1/467 12345").
func parseLoad1(s string) (float64, error) {
	f := strings.Fields(s)
	if len(f) < 3 {
		return 0, fmt.Errorf("loadavg %q: want three averages", truncate(s, 60))
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil || v < 0 {
		return 0, fmt.Errorf("loadavg %q: the first field is not a load average", truncate(s, 60))
	}
	return v, nil
}

// load1 reads the machine's one-minute load average; nil when it cannot.
func load1() *float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return nil
	}
	v, err := parseLoad1(string(b))
	if err != nil {
		return nil
	}
	return &v
}

func (m Machine) summary() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d cores (%s), %d MiB, kernel %s, load %s; %s; PostgreSQL %s",
		m.NumCPU, m.CPUModel, m.MemoryMiB, m.Kernel, m.LoadAvg, m.Go, m.PostgreSQL)
	for _, k := range []string{"autovacuum", "fsync", "synchronous_commit", "shared_buffers"} {
		if v, ok := m.PostgreSQLSettings[k]; ok {
			fmt.Fprintf(&b, " %s=%s", k, v)
		}
	}
	fmt.Fprintf(&b, "; RabbitMQ %s", m.RabbitMQ)
	if m.FerretDB != "" {
		fmt.Fprintf(&b, "; FerretDB %s (SQLite)", m.FerretDB)
	}
	return b.String()
}

// ferretVersion asks the embedded FerretDB its version, if the run started
// one. It must be called before close stops it; "" when there is none.
func (e *env) ferretVersion() (string, error) {
	if e.mongo == nil {
		return "", nil
	}
	return e.ferretDBVersion, nil
}

// readFerretVersion records the embedded server's version while it runs.
func (e *env) readFerretVersion(ctx context.Context, uri string) {
	client, err := mongo.Connect(options.Client().ApplyURI(uri))
	if err != nil {
		return
	}
	defer client.Disconnect(context.WithoutCancel(ctx)) //nolint:errcheck
	var info bson.M
	if err := client.Database("admin").RunCommand(ctx, bson.D{{Key: "buildInfo", Value: 1}}).Decode(&info); err != nil {
		return
	}
	// A build from the module proxy reports "unknown": the module's version
	// in this binary is the reliable one.
	v, _ := info["ferretdbVersion"].(string)
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == "github.com/FerretDB/FerretDB" {
				v = d.Version
			}
		}
	}
	if mv, ok := info["version"].(string); ok {
		v += " (reports MongoDB " + mv + ")"
	}
	e.ferretDBVersion = v
}
