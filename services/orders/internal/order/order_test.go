package order

import (
	"errors"
	"strings"
	"testing"
)

func ptr[T any](v T) *T { return &v }

func validRequest() CreateRequest {
	return CreateRequest{
		CustomerID: ptr("c-42"),
		Currency:   ptr("EUR"),
		Items: []RequestItem{
			{SKU: ptr("sku-1"), Quantity: ptr(int64(2)), UnitPrice: ptr(int64(1250))},
			{SKU: ptr("sku-2"), Quantity: ptr(int64(1)), UnitPrice: ptr(int64(99))},
		},
	}
}

func TestValidateComputesTotal(t *testing.T) {
	n, err := validRequest().Validate()
	if err != nil {
		t.Fatal(err)
	}
	if n.Total != 2*1250+99 || len(n.Items) != 2 || n.Currency != "EUR" || n.CustomerID != "c-42" {
		t.Fatalf("got %+v", n)
	}
}

func TestValidateRejects(t *testing.T) {
	many := make([]RequestItem, MaxItems+1)
	for i := range many {
		many[i] = RequestItem{SKU: ptr("s"), Quantity: ptr(int64(1)), UnitPrice: ptr(int64(1))}
	}
	maxed := make([]RequestItem, 20)
	for i := range maxed {
		maxed[i] = RequestItem{SKU: ptr("s"), Quantity: ptr(int64(MaxQuantity)), UnitPrice: ptr(int64(MaxUnitPrice))}
	}
	cases := []struct {
		name, field string
		mutate      func(r *CreateRequest)
	}{
		{"missing customer", "customer_id", func(r *CreateRequest) { r.CustomerID = nil }},
		{"blank customer", "customer_id", func(r *CreateRequest) { r.CustomerID = ptr("  ") }},
		{"NUL in customer", "customer_id", func(r *CreateRequest) { r.CustomerID = ptr("c\x00") }},
		{"control char", "customer_id", func(r *CreateRequest) { r.CustomerID = ptr("c\x1b[2J") }},
		{"long customer", "customer_id", func(r *CreateRequest) { r.CustomerID = ptr(strings.Repeat("x", MaxTextLength+1)) }},
		{"missing currency", "currency", func(r *CreateRequest) { r.Currency = nil }},
		{"lower-case currency", "currency", func(r *CreateRequest) { r.Currency = ptr("eur") }},
		{"missing items", "items", func(r *CreateRequest) { r.Items = nil }},
		{"no items", "items", func(r *CreateRequest) { r.Items = []RequestItem{} }},
		{"too many items", "items", func(r *CreateRequest) { r.Items = many }},
		{"missing sku", "items[0].sku", func(r *CreateRequest) { r.Items[0].SKU = nil }},
		{"NUL in sku", "items[1].sku", func(r *CreateRequest) { r.Items[1].SKU = ptr("a\x00") }},
		{"missing quantity", "items[0].quantity", func(r *CreateRequest) { r.Items[0].Quantity = nil }},
		{"zero quantity", "items[0].quantity", func(r *CreateRequest) { r.Items[0].Quantity = ptr(int64(0)) }},
		{"negative quantity", "items[1].quantity", func(r *CreateRequest) { r.Items[1].Quantity = ptr(int64(-3)) }},
		{"huge quantity", "items[0].quantity", func(r *CreateRequest) { r.Items[0].Quantity = ptr(int64(MaxQuantity + 1)) }},
		{"missing price", "items[0].unit_price", func(r *CreateRequest) { r.Items[0].UnitPrice = nil }},
		{"zero price", "items[0].unit_price", func(r *CreateRequest) { r.Items[0].UnitPrice = ptr(int64(0)) }},
		{"negative price", "items[0].unit_price", func(r *CreateRequest) { r.Items[0].UnitPrice = ptr(int64(-1)) }},
		{"total overflow", "items", func(r *CreateRequest) { r.Items = maxed }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := validRequest()
			r.Items = append([]RequestItem(nil), r.Items...)
			tc.mutate(&r)
			_, err := r.Validate()
			var ve *ValidationError
			if !errors.As(err, &ve) {
				t.Fatalf("error = %v, want a *ValidationError", err)
			}
			if ve.Field != tc.field {
				t.Fatalf("field = %q (%v), want %q", ve.Field, ve, tc.field)
			}
		})
	}
}

func TestCheckIdempotencyKey(t *testing.T) {
	for _, k := range []string{"", "has space", "tab\t", strings.Repeat("k", MaxIdemKeySize+1), "é"} {
		if CheckIdempotencyKey(k) == nil {
			t.Errorf("key %q accepted", k)
		}
	}
	if err := CheckIdempotencyKey("3f2a-retry_1"); err != nil {
		t.Errorf("valid key rejected: %v", err)
	}
}
