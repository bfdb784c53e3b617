package main

import (
	"errors"
	"math"
	"slices"
	"time"
)

// Latencies summarises a set of measured durations.
type Latencies struct {
	N   int           `json:"n"`
	P50 time.Duration `json:"p50_ns"`
	P90 time.Duration `json:"p90_ns"`
	P99 time.Duration `json:"p99_ns"`
	Max time.Duration `json:"max_ns"`
}

// summarize sorts ds in place and returns its percentiles. It returns an
// error for an empty set: a latency figure without samples is a failed
// measurement, never a zero.
func summarize(ds []time.Duration) (Latencies, error) {
	if len(ds) == 0 {
		return Latencies{}, errors.New("no samples")
	}
	slices.Sort(ds)
	return Latencies{
		N:   len(ds),
		P50: percentile(ds, 50),
		P90: percentile(ds, 90),
		P99: percentile(ds, 99),
		Max: ds[len(ds)-1],
	}, nil
}

// percentile returns the nearest-rank p-th percentile of sorted: the smallest
// sample that at least p percent of the samples do not exceed. sorted must be
// sorted and non-empty, and p in (0, 100].
func percentile(sorted []time.Duration, p float64) time.Duration {
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	rank = min(max(rank, 1), len(sorted))
	return sorted[rank-1]
}

// ms converts d to milliseconds, the unit of every latency figure.
func ms(d time.Duration) float64 {
	return float64(d) / float64(time.Millisecond)
}

// rate is n events over d, per second.
func rate(n int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

// median returns the median of xs (the mean of the two middle values for an
// even count), without changing xs. It returns 0 for an empty slice.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
