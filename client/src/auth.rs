//! The auth calls of [`Client`]: the switch, users and roles (root only once auth is on).
//! Token handling itself (`with_token`, `with_credentials`, `authenticate`) is in the parent.

use reqwest::Method;

use super::{CallOptions, Client, ClientError, encode_query};
use crate::api::{
    AuthChanged, AuthStatus, Credentials, PasswordRequest, RoleList, RoleRequest, UserList,
};
use crate::api::{PermKind, Permission, RoleInfo, UserInfo};

/// Writes are not retried after an uncertain delivery (the client's rule for non-GETs).
const WRITE: CallOptions = CallOptions {
    idempotent: false,
    timeout: None,
};

impl Client {
    pub async fn auth_status(&self) -> Result<AuthStatus, ClientError> {
        self.call(Method::GET, "/v1/auth/status", None::<&()>).await
    }

    pub async fn auth_enable(&self) -> Result<AuthStatus, ClientError> {
        self.call(Method::POST, "/v1/auth/enable", None::<&()>)
            .await
    }

    pub async fn auth_disable(&self) -> Result<AuthStatus, ClientError> {
        self.call(Method::POST, "/v1/auth/disable", None::<&()>)
            .await
    }

    pub async fn user_add(&self, name: &str, password: &str) -> Result<AuthChanged, ClientError> {
        let body = Credentials {
            name: name.into(),
            password: password.into(),
        };
        self.call_with(Method::POST, "/v1/auth/users", Some(&body), WRITE)
            .await
    }

    pub async fn user_delete(&self, name: &str) -> Result<AuthChanged, ClientError> {
        let path = format!("/v1/auth/users/{}", encode_query(name));
        self.call(Method::DELETE, &path, None::<&()>).await
    }

    pub async fn user_passwd(
        &self,
        name: &str,
        password: &str,
    ) -> Result<AuthChanged, ClientError> {
        let path = format!("/v1/auth/users/{}/password", encode_query(name));
        let body = PasswordRequest {
            password: password.into(),
        };
        self.call(Method::PUT, &path, Some(&body)).await
    }

    pub async fn user_grant_role(
        &self,
        name: &str,
        role: &str,
    ) -> Result<AuthChanged, ClientError> {
        let path = format!(
            "/v1/auth/users/{}/roles/{}",
            encode_query(name),
            encode_query(role)
        );
        self.call(Method::PUT, &path, None::<&()>).await
    }

    pub async fn user_revoke_role(
        &self,
        name: &str,
        role: &str,
    ) -> Result<AuthChanged, ClientError> {
        let path = format!(
            "/v1/auth/users/{}/roles/{}",
            encode_query(name),
            encode_query(role)
        );
        self.call(Method::DELETE, &path, None::<&()>).await
    }

    pub async fn user_get(&self, name: &str) -> Result<UserInfo, ClientError> {
        let path = format!("/v1/auth/users/{}", encode_query(name));
        self.call(Method::GET, &path, None::<&()>).await
    }

    pub async fn user_list(&self) -> Result<UserList, ClientError> {
        self.call(Method::GET, "/v1/auth/users", None::<&()>).await
    }

    pub async fn role_add(&self, name: &str) -> Result<AuthChanged, ClientError> {
        let body = RoleRequest { name: name.into() };
        self.call_with(Method::POST, "/v1/auth/roles", Some(&body), WRITE)
            .await
    }

    pub async fn role_delete(&self, name: &str) -> Result<AuthChanged, ClientError> {
        let path = format!("/v1/auth/roles/{}", encode_query(name));
        self.call(Method::DELETE, &path, None::<&()>).await
    }

    pub async fn role_get(&self, name: &str) -> Result<RoleInfo, ClientError> {
        let path = format!("/v1/auth/roles/{}", encode_query(name));
        self.call(Method::GET, &path, None::<&()>).await
    }

    pub async fn role_list(&self) -> Result<RoleList, ClientError> {
        self.call(Method::GET, "/v1/auth/roles", None::<&()>).await
    }

    /// Grant `kind` on `key` (or on every key under it, with `prefix`) to role `name`.
    pub async fn role_grant(
        &self,
        name: &str,
        kind: PermKind,
        key: &str,
        prefix: bool,
    ) -> Result<AuthChanged, ClientError> {
        let path = format!("/v1/auth/roles/{}/permissions", encode_query(name));
        let body = Permission {
            kind,
            key: key.into(),
            prefix,
        };
        self.call(Method::POST, &path, Some(&body)).await
    }

    pub async fn role_revoke(
        &self,
        name: &str,
        key: &str,
        prefix: bool,
    ) -> Result<AuthChanged, ClientError> {
        let path = format!(
            "/v1/auth/roles/{}/permissions?key={}&prefix={prefix}",
            encode_query(name),
            encode_query(key)
        );
        self.call(Method::DELETE, &path, None::<&()>).await
    }
}
