// csi-mock-driver is the CSI driver the Kubernetes e2e suite's CSI Mock specs expect in their mock
// pod when they run the driver in the cluster (storage-csi/mock/csi-mock-driver.yaml starts
// csi-driver-host-path's image there, with hostpathplugin's flags). It serves the suite's own mock
// CSI service (k8s.io/kubernetes/test/e2e/storage/drivers/csi-test), which logs every call in the
// form the specs read back from the container's log ("gRPCCall: {...}", at -v=3 and up).
//
// csi-driver-host-path cannot be built on this project's machines (the Go module proxy does not serve
// it); localstack/csi_mock.py puts this binary, and kubeloop's proxy for the specs that embed the
// mock in e2e.test, in its image's place. tools/build-binaries.sh csi-mock builds it.
package main

import (
	"flag"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/e2e/storage/drivers/csi-test/driver"
	"k8s.io/kubernetes/test/e2e/storage/drivers/csi-test/mock/service"
)

func main() {
	klog.InitFlags(nil)
	name := flag.String("drivername", "hostpath.csi.k8s.io", "the driver's name (GetPluginInfo)")
	endpoint := flag.String("endpoint", "unix://tmp/csi.sock", "the CSI socket: unix://PATH or a path")
	attach := flag.Bool("enable-attach", false, "offer ControllerPublishVolume (PUBLISH_UNPUBLISH_VOLUME)")
	limit := flag.Int64("attach-limit", 0, "the volumes a node takes (NodeGetInfo max_volumes_per_node)")
	nodeExpand := flag.Bool("node-expand-required", false, "offer NodeExpandVolume (EXPAND_VOLUME on the node)")
	topology := flag.Bool("enable-topology", false, "offer topology (VOLUME_ACCESSIBILITY_CONSTRAINTS)")
	// hostpathplugin's own, which the mock manifest passes and the mock has no use for: it keeps
	// its state in memory and answers NodeGetInfo with its own node id.
	flag.String("nodeid", "", "ignored: the mock has its own node id")
	flag.String("statedir", "", "ignored: the mock keeps its state in memory")
	flag.Parse()

	mock := service.New(service.Config{
		DisableAttach:         !*attach,
		DriverName:            *name,
		AttachLimit:           *limit,
		NodeExpansionRequired: *nodeExpand,
		EnableTopology:        *topology,
		IO:                    service.OSDirIO{},
	})
	path := strings.TrimPrefix(strings.TrimPrefix(*endpoint, "unix://"), "unix:")
	if !strings.HasPrefix(path, "/") {
		path = "/" + path
	}
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		klog.Fatalf("removing a stale socket %s: %v", path, err)
	}
	listener, err := net.Listen("unix", path)
	if err != nil {
		klog.Fatalf("listening on %s: %v", path, err)
	}
	csi := driver.NewCSIDriver(&driver.CSIDriverServers{Controller: mock, Identity: mock, Node: mock})
	if err := csi.Start(listener, nil); err != nil {
		klog.Fatalf("serving %s: %v", path, err)
	}
	klog.Infof("mock CSI driver %s serving on %s", *name, path)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
	csi.Stop()
	_ = os.Remove(path)
}
