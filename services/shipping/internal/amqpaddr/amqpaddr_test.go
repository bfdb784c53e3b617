package amqpaddr_test

import (
	"net"
	"net/url"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/services/shipping/internal/amqpaddr"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
)

func TestParse(t *testing.T) {
	tests := []struct {
		in      string
		want    []string
		wantErr string
	}{
		{in: "amqp://guest:guest@127.0.0.1:5672/", want: []string{"amqp://guest:guest@127.0.0.1:5672/"}},
		{
			in:   "amqp://u:p@n1:5672/v, amqp://u:p@n2:5673/v ,amqps://u:p@n3/v",
			want: []string{"amqp://u:p@n1:5672/v", "amqp://u:p@n2:5673/v", "amqps://u:p@n3/v"},
		},
		{in: "amqp://u:a%2Cb@n1/v", want: []string{"amqp://u:a%2Cb@n1/v"}},
		{in: "amqp://n1/,", wantErr: "empty address"},
		{in: "", wantErr: "empty address"},
		{in: "amqp://n1/,http://n2/", wantErr: "address 2"},
	}
	for _, tt := range tests {
		got, err := amqpaddr.Parse(tt.in)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("Parse(%q) = %q, %v; want an error with %q", tt.in, got, err, tt.wantErr)
			}
			continue
		}
		if err != nil || strings.Join(got, " ") != strings.Join(tt.want, " ") {
			t.Errorf("Parse(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
}

// The first node down: Dial connects to the second; the next Dial starts
// after it (so a connection lost with its node goes elsewhere), and with
// every node down the error names each one.
func TestDialFailsOver(t *testing.T) {
	_, live := amqptest.VHost(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := ln.Addr().String()
	_ = ln.Close()
	u, err := url.Parse(live)
	if err != nil {
		t.Fatal(err)
	}
	liveAddr := u.Host
	u.Host = deadAddr
	dead := u.String()

	nodes, err := amqpaddr.New(dead + "," + live)
	if err != nil {
		t.Fatal(err)
	}
	conn, node, err := nodes.Dial(amqp.Config{})
	if err != nil {
		t.Fatalf("Dial with the second node up: %v", err)
	}
	if node != liveAddr {
		t.Errorf("connected to %s, want %s", node, liveAddr)
	}
	if _, err := conn.Channel(); err != nil {
		t.Fatalf("open a channel on the second node: %v", err)
	}
	_ = conn.Close()

	// The next Dial starts after the live node: the dead one first, then
	// round to the live one again.
	conn, node, err = nodes.Dial(amqp.Config{})
	if err != nil || node != liveAddr {
		t.Fatalf("second Dial: %s, %v", node, err)
	}
	_ = conn.Close()

	allDead, err := amqpaddr.New(dead + "," + dead)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := allDead.Dial(amqp.Config{}); err == nil || strings.Count(err.Error(), deadAddr+": dial") != 2 {
		t.Errorf("Dial with every node down = %v; want both nodes named", err)
	}
}
