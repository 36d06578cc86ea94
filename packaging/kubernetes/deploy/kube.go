package deploy

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// ServiceAccountDir is where Kubernetes mounts a pod's service account: token, ca.crt.
const ServiceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"

// Kube is the API server as a pod sees it: enough of a client to patch its node's labels.
type Kube struct {
	// Server is the API server's URL (https://HOST:PORT).
	Server string
	// TokenFile is the service account's token, read at each request (the kubelet rotates
	// it).
	TokenFile string
	client    *http.Client
}

// InCluster is the API server of the pod's service account: KUBERNETES_SERVICE_HOST and
// _PORT from the environment, the token and CA in saDir. It returns nil and no error when
// there is no token (no service account mounted, or not in a cluster).
func InCluster(saDir string) (*Kube, error) {
	token := filepath.Join(saDir, "token")
	if _, err := os.Stat(token); errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
	if host == "" || port == "" {
		return nil, fmt.Errorf("a service account token in %s but no KUBERNETES_SERVICE_HOST and _PORT", saDir)
	}
	ca, err := os.ReadFile(filepath.Join(saDir, "ca.crt"))
	if err != nil {
		return nil, fmt.Errorf("the API server's CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("%s: no PEM certificate", filepath.Join(saDir, "ca.crt"))
	}
	return &Kube{
		Server:    "https://" + net.JoinHostPort(host, port),
		TokenFile: token,
		client: &http.Client{
			Timeout:   30 * time.Second,
			Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}},
		},
	}, nil
}

// LabelNode sets the label key on node to value, or removes it when value is empty, with a
// JSON merge patch of the node's metadata (RBAC: patch on nodes).
func (k *Kube) LabelNode(ctx context.Context, node, key, value string) error {
	token, err := os.ReadFile(k.TokenFile)
	if err != nil {
		return fmt.Errorf("the service account token: %w", err)
	}
	var v any // null removes the label
	if value != "" {
		v = value
	}
	body, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{key: v}}})
	if err != nil {
		return err
	}
	u := k.Server + "/api/v1/nodes/" + url.PathEscape(node)
	req, err := http.NewRequestWithContext(ctx, http.MethodPatch, u, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/merge-patch+json")
	req.Header.Set("Accept", "application/json")
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	resp, err := k.client.Do(req)
	if err != nil {
		return fmt.Errorf("labelling node %s: %w", node, err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("labelling node %s: PATCH %s: %s: %s", node, u, resp.Status, strings.TrimSpace(string(msg)))
	}
	return nil
}
