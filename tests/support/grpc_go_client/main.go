// A gRPC client on grpc-go, as kubelet's plugin watcher and the Go sidecars are: it calls one
// unary method on a unix socket with the request given in hex and prints the response in hex, or
// the call's status as `code=<Code> message=<message>`, so tests/unit/test_grpc_lite.py can check
// kubeloop's grpc_lite server against the client kubelet uses. No generated stubs: messages are
// passed as bytes through a codec of its own.
//
//	grpc-go-client unix:///path/to.sock /pluginregistration.Registration/GetInfo [hex] [timeout]
package main

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/status"
)

// rawCodec passes a message's bytes through unchanged.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "proto" } // content-type application/grpc, as stubs send

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: grpc-go-client TARGET METHOD [HEX] [TIMEOUT]")
		os.Exit(2)
	}
	request := []byte{}
	if len(os.Args) > 3 {
		var err error
		if request, err = hex.DecodeString(os.Args[3]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
	}
	timeout := 5 * time.Second
	if len(os.Args) > 4 {
		timeout, _ = time.ParseDuration(os.Args[4])
	}
	encoding.RegisterCodec(rawCodec{})
	conn, err := grpc.NewClient(os.Args[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var response []byte
	if err := conn.Invoke(ctx, os.Args[2], &request, &response); err != nil {
		s := status.Convert(err)
		fmt.Printf("code=%s message=%s\n", s.Code(), s.Message())
		return
	}
	fmt.Printf("ok=%s\n", hex.EncodeToString(response))
}
