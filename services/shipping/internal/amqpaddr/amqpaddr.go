// Package amqpaddr reads an AMQP_URL that may list the nodes of a RabbitMQ
// cluster and dials them in turn: the shipping service's consuming,
// publishing and dead-letter connections move to another node when theirs is
// lost.
package amqpaddr

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// Parse splits s at its commas and checks each part as an AMQP URI (amqp://
// or amqps://; a comma in a password is written %2C). It is the relay's
// outboxamqp.ParseURLs, so AMQP_URL means the same to both services.
func Parse(s string) ([]string, error) { return outboxamqp.ParseURLs(s) }

// Nodes dials a list of nodes in turn. The zero value is not usable: see New.
type Nodes struct {
	urls  []string
	hosts []string

	mu   sync.Mutex
	next int // the node the next Dial tries first
}

// New parses s (see Parse).
func New(s string) (*Nodes, error) {
	urls, err := Parse(s)
	if err != nil {
		return nil, err
	}
	n := &Nodes{urls: urls, hosts: make([]string, len(urls))}
	for i, u := range urls {
		uri, _ := amqp.ParseURI(u) // checked by Parse
		n.hosts[i] = net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port))
	}
	return n, nil
}

// Len is the number of nodes.
func (n *Nodes) Len() int { return len(n.urls) }

// Dial tries each node once, starting after the node of the previous
// successful Dial (so a connection lost with its node is replaced by one to
// another node), and returns the first connection that opens, with the node's
// host:port. cfg is used for every attempt; a zero Dial gets a 5s timeout.
func (n *Nodes) Dial(cfg amqp.Config) (*amqp.Connection, string, error) {
	if cfg.Dial == nil {
		cfg.Dial = amqp.DefaultDial(5 * time.Second)
	}
	n.mu.Lock()
	start := n.next
	n.mu.Unlock()
	var errs []error
	for k := range n.urls {
		i := (start + k) % len(n.urls)
		conn, err := amqp.DialConfig(n.urls[i], cfg)
		if err == nil {
			n.mu.Lock()
			n.next = (i + 1) % len(n.urls)
			n.mu.Unlock()
			return conn, n.hosts[i], nil
		}
		if len(n.urls) > 1 {
			err = fmt.Errorf("%s: %w", n.hosts[i], err)
		}
		errs = append(errs, err)
	}
	return nil, "", errors.Join(errs...)
}

// Fork returns the same nodes with a cursor of their own, for another
// connection that should rotate independently.
func (n *Nodes) Fork() *Nodes {
	n.mu.Lock()
	defer n.mu.Unlock()
	return &Nodes{urls: n.urls, hosts: n.hosts, next: n.next}
}
