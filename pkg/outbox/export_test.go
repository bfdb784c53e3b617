package outbox

// ClaimSQL lets the external tests EXPLAIN the claim.
const ClaimSQL = claimSQL
