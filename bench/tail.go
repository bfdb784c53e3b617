package main

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The latency tail, with the instrument. An e2e_latency p99 is the latency
// of its slowest 1% of orders: a handful of events in a 20-second window.
// What the benchmark records for each of them says where their time went:
// the relay's share (commit to the tap's delivery), shipping's share
// (delivery to applied), how many separate moments they were committed in
// (one stall or many), and how busy the machine's CPUs were while they
// waited, from /proc/stat sampled every 100 ms: the share busy, and the share
// stolen by the hypervisor for other machines (steal), which no process here
// can see in its own CPU time.

// cpuTimes is the first line of /proc/stat: the whole machine's CPU time by
// state, in clock ticks.
type cpuTimes struct {
	busy, idle, iowait, steal uint64
}

// parseProcStatCPU reads the "cpu" line of /proc/stat's text: user nice
// system idle iowait irq softirq steal (guest time is already in user).
func parseProcStatCPU(r io.Reader) (cpuTimes, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 || f[0] != "cpu" {
			continue
		}
		if len(f) < 9 {
			return cpuTimes{}, fmt.Errorf("/proc/stat cpu line has %d fields, want at least 9", len(f))
		}
		var n [8]uint64
		for i := range n {
			v, err := strconv.ParseUint(f[i+1], 10, 64)
			if err != nil {
				return cpuTimes{}, fmt.Errorf("/proc/stat cpu field %d: %w", i+1, err)
			}
			n[i] = v
		}
		user, nice, system, idle, iowait, irq, softirq, steal := n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7]
		return cpuTimes{busy: user + nice + system + irq + softirq, idle: idle, iowait: iowait, steal: steal}, nil
	}
	if err := sc.Err(); err != nil {
		return cpuTimes{}, err
	}
	return cpuTimes{}, fmt.Errorf("no cpu line in /proc/stat")
}

// machineSample is one reading of /proc/stat.
type machineSample struct {
	at time.Time
	t  cpuTimes
}

// machineLoad is the machine's CPU over an interval, as shares of its CPU
// time (all cores): busy (processes and interrupts), waiting on I/O, and
// stolen by the hypervisor.
type machineLoad struct {
	Busy   float64 `json:"busy"`
	IOWait float64 `json:"iowait"`
	Steal  float64 `json:"steal"`
}

// machineSampler reads /proc/stat every interval until stopped.
type machineSampler struct {
	mu      sync.Mutex
	samples []machineSample
	stop    func()
	done    chan struct{}
}

// startMachineSampler starts sampling; it returns an error when /proc/stat
// cannot be read (not Linux).
func startMachineSampler(ctx context.Context, every time.Duration) (*machineSampler, error) {
	read := func() (machineSample, error) {
		f, err := os.Open("/proc/stat")
		if err != nil {
			return machineSample{}, err
		}
		defer f.Close()
		t, err := parseProcStatCPU(f)
		return machineSample{at: time.Now(), t: t}, err
	}
	first, err := read()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	m := &machineSampler{samples: []machineSample{first}, stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(m.done)
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if s, err := read(); err == nil {
				m.mu.Lock()
				m.samples = append(m.samples, s)
				m.mu.Unlock()
			}
		}
	}()
	return m, nil
}

// finish stops the sampler and returns its samples, in time order.
func (m *machineSampler) finish() []machineSample {
	m.stop()
	<-m.done
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.samples
}

// loadBetween returns the machine's load from the last sample at or before
// from to the first at or after to (so a short interval is widened to the
// samples around it), and false when the samples do not cover it.
func loadBetween(samples []machineSample, from, to time.Time) (machineLoad, bool) {
	i := -1
	for k, s := range samples {
		if !s.at.After(from) {
			i = k
		}
	}
	j := slices.IndexFunc(samples, func(s machineSample) bool { return !s.at.Before(to) })
	if i < 0 || j < 0 || j <= i {
		return machineLoad{}, false
	}
	a, b := samples[i].t, samples[j].t
	busy, idle, iowait, steal := b.busy-a.busy, b.idle-a.idle, b.iowait-a.iowait, b.steal-a.steal
	total := busy + idle + iowait + steal
	if total == 0 {
		return machineLoad{}, false
	}
	share := func(x uint64) float64 { return round(float64(x) / float64(total)) }
	return machineLoad{Busy: share(busy), IOWait: share(iowait), Steal: share(steal)}, true
}

// orderTrip is one measured order's way: its commit, its first delivery to
// the tap (zero when the tap missed it) and its latency (to applied, or to
// delivery where no shipping service runs).
type orderTrip struct {
	committed time.Time
	delivered time.Time
	latency   time.Duration
}

// tailReport says where the slowest orders' time went.
type tailReport struct {
	// Orders is how many orders are in the tail: the p99's and those slower.
	Orders int     `json:"orders"`
	FromMs float64 `json:"from_ms"` // the p99: the tail's fastest
	// RelayShareMs and ShippingShareMs are the median over the tail of
	// commit to delivery and of delivery to applied.
	RelayShareMs    float64 `json:"relay_share_median_ms"`
	ShippingShareMs float64 `json:"shipping_share_median_ms"`
	// Moments is how many separate seconds the tail's orders were committed
	// in: 1 or 2 is one stall, many is a tail spread over the window.
	Moments int `json:"moments"`
	// During is the machine's load while the tail's orders waited (the
	// median over them of their commit to their latency's end), Window the
	// same over the whole measured window.
	During *machineLoad `json:"machine_during_tail,omitempty"`
	Window *machineLoad `json:"machine_during_window,omitempty"`
}

// tailOf returns the tail of trips: the orders from the p99's rank up (the
// slowest 1%, at least one order).
func tailOf(trips []orderTrip, samples []machineSample) tailReport {
	if len(trips) == 0 {
		return tailReport{}
	}
	sorted := slices.Clone(trips)
	slices.SortStableFunc(sorted, func(a, b orderTrip) int { return cmp.Compare(a.latency, b.latency) })
	rank := min(max(int(math.Ceil(0.99*float64(len(sorted)))), 1), len(sorted))
	tail := sorted[rank-1:]
	r := tailReport{Orders: len(tail), FromMs: ms(tail[0].latency)}
	var relay, shipping, busy, iowait, steal []float64
	seconds := map[int64]bool{}
	for _, t := range tail {
		seconds[t.committed.Unix()] = true
		if !t.delivered.IsZero() {
			d := t.delivered.Sub(t.committed)
			relay = append(relay, ms(d))
			shipping = append(shipping, ms(t.latency-d))
		}
		if l, ok := loadBetween(samples, t.committed, t.committed.Add(t.latency)); ok {
			busy, iowait, steal = append(busy, l.Busy), append(iowait, l.IOWait), append(steal, l.Steal)
		}
	}
	r.Moments = len(seconds)
	r.RelayShareMs, r.ShippingShareMs = round(median(relay)), round(median(shipping))
	if len(busy) > 0 {
		r.During = &machineLoad{Busy: median(busy), IOWait: median(iowait), Steal: median(steal)}
	}
	if len(samples) > 1 {
		first, last := trips[0].committed, trips[0].committed
		for _, t := range trips {
			if t.committed.Before(first) {
				first = t.committed
			}
			if end := t.committed.Add(t.latency); end.After(last) {
				last = end
			}
		}
		if l, ok := loadBetween(samples, first, last); ok {
			r.Window = &l
		}
	}
	return r
}
