package shipment

// VersionRef names one version of one order's chain of events: where an
// event applies, whichever message it is.
type VersionRef struct {
	OrderID string
	Version int64
}
