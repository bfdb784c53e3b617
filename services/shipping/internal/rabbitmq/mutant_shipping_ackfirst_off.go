//go:build !mutant_shipping_ackfirst

package rabbitmq

// mutantShippingAckFirst is the planted bug of make chaos-mutants built with
// -tags mutant_shipping_ackfirst (mutant_shipping_ackfirst.go): off in every
// other build, where the code it guards is dead and the compiler drops it.
const mutantShippingAckFirst = false
