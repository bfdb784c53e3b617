//go:build mutant_shipping_ackfirst

package rabbitmq

// mutantShippingAckFirst plants a bug for make chaos-mutants
// (e2e/chaos.Mutants): the consumer acknowledges each delivery as it arrives,
// before the handler and the inbox record. Only a build with -tags
// mutant_shipping_ackfirst has it; see mutant_shipping_ackfirst_off.go.
const mutantShippingAckFirst = true
